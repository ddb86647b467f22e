"""Scheduler and KV manager on the CPU, without a model: a tiny simulator plays the
engine's part (computed tokens advance, a caught-up sequence emits one token)."""


from slimkv.config import KVCacheConfig, SchedulerConfig
from slimkv.kv.block_pool import BlockPool
from slimkv.kv.manager import KVCacheManager
from slimkv.engine.sampling import SamplingParams
from slimkv.engine.scheduler import Scheduler
from slimkv.engine.sequence import Sequence, SequenceStatus

BS = 4


class Sim:
    def __init__(self, num_blocks=64, budget=32, soft=48, watermark=1.0, policy="fcfs",
                 evict="lru_block", slots=0, **sched):
        self.pool = BlockPool(num_blocks, evict_policy=evict)
        kv = KVCacheConfig(block_size=BS, max_concurrency_soft=soft, watermark=watermark,
                           num_blocks=num_blocks)
        self.manager = KVCacheManager(self.pool, BS, session_ttl_s=kv.session_ttl_s,
                                      num_staging_slots=slots)
        self.sched = Scheduler(kv, SchedulerConfig(policy=policy, max_num_batched_tokens=budget,
                                                   **sched), self.manager)
        self.steps = 0
        self.max_running = 0
        self.prefilled: dict[str, int] = {}

    def add(self, rid, prompt, max_tokens=4, session=None, base=0):
        seq = Sequence(rid, [base + i for i in range(prompt)], SamplingParams(max_tokens=max_tokens),
                       session_id=session)
        seq.arrival_step = self.steps
        self.sched.add(seq)
        return seq

    def step(self):
        self.steps += 1
        out = self.sched.schedule()
        self.max_running = max(self.max_running, len(self.sched.running))
        for seq, n in out.scheduled:
            if seq.num_computed_tokens + n <= seq.num_prompt_tokens or seq.num_output_tokens == 0:
                self.prefilled[seq.request_id] = self.prefilled.get(seq.request_id, 0) + n
            seq.num_computed_tokens += n
            self.manager.cache_full_blocks(seq)
        for seq, n in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                if seq.first_token_step is None:
                    seq.first_token_step = self.steps
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    self.sched.remove(seq)
                    self.manager.free(seq)
                    seq.status = SequenceStatus.FINISHED
        return out

    def run(self, limit=10_000):
        while self.sched.running or self.sched.waiting:
            self.step()
            assert self.steps < limit, "scheduler made no progress"


def test_soft_limit_queues_instead_of_failing():
    sim = Sim(num_blocks=512, soft=4)
    seqs = [sim.add(f"r{i}", 10) for i in range(12)]
    sim.run()
    assert sim.max_running == 4
    assert all(s.is_finished for s in seqs)
    assert sim.pool.num_free_blocks == 512


def test_chunked_prefill_respects_the_token_budget():
    sim = Sim(budget=8)
    sim.add("a", 20)
    out = sim.step()
    assert out.scheduled[0][1] == 8 and out.num_tokens <= 8


def test_watermark_stops_admission_and_resumes_below_it():
    sim = Sim(num_blocks=10, watermark=0.5, budget=100)
    a = sim.add("a", 4 * BS - 1, max_tokens=2)   # 4 blocks once it decodes
    b = sim.add("b", 2 * BS - 1, max_tokens=2)   # 2 blocks: usage 0.6 >= 0.5
    sim.step()
    assert a.status is SequenceStatus.RUNNING and b.status is SequenceStatus.RUNNING
    c = sim.add("c", 3)
    sim.step()
    assert sim.sched.watermark_alert and c.status is SequenceStatus.WAITING
    sim.run()
    assert not sim.sched.watermark_alert and c.is_finished


def test_preemption_by_recompute_completes_everything():
    sim = Sim(num_blocks=8, budget=64)
    seqs = [sim.add(f"r{i}", 6, max_tokens=8) for i in range(3)]   # 3 x 4 blocks > 8
    sim.run()
    assert sim.sched.num_preemptions > 0
    assert all(s.is_finished and s.num_output_tokens == 8 for s in seqs)
    assert sim.pool.num_free_blocks == 8


def test_prefix_hit_reuses_exact_blocks_and_skips_their_prefill():
    sim = Sim(budget=64)
    sim.add("a", 3 * BS + 1, max_tokens=1)
    sim.run()
    first_ids = [b.block_id for b in sim.pool.blocks if b.block_hash is not None]
    assert len(first_ids) == 3
    b = sim.add("b", 3 * BS + 2, max_tokens=2)
    sim.step()
    assert [blk.block_id for blk in b.blocks[:3]] == first_ids
    assert b.num_cached_tokens == 3 * BS
    assert sim.prefilled["b"] == 2
    assert sim.manager.num_prefix_hits == 3 * BS


def test_weighted_lanes_keep_short_requests_moving_behind_a_long_prefill():
    """One 4K-token prompt first, then 16 short requests; TTFT counted in engine steps."""
    def short_ttft(policy, with_long):
        sim = Sim(num_blocks=4096, budget=512, policy=policy, long_request_blocks=64)
        if with_long:
            sim.add("long", 4096, max_tokens=8)
        shorts = [sim.add(f"s{i}", 60, max_tokens=4, base=5000 + 100 * i) for i in range(16)]
        sim.run()
        assert all(s.is_finished for s in shorts)
        return max(s.first_token_step - s.arrival_step for s in shorts)

    alone = short_ttft("weighted", False)
    weighted = short_ttft("weighted", True)
    fcfs = short_ttft("fcfs", True)
    assert weighted <= 3 * alone
    assert fcfs >= 3 * weighted


def test_weighted_policy_puts_heavy_requests_in_the_slow_lane():
    sim = Sim(policy="weighted", long_request_blocks=4)
    assert sim.add("short", 8, max_tokens=4).lane == "fast"
    assert sim.add("long", 20, max_tokens=4).lane == "slow"


def test_contiguous_manager_reserves_max_model_len_and_counts_false_ooms():
    """The baseline composes the paged manager: a reservation of max_model_len per request,
    staging slots and freeing from the paged one, a false OOM when only reservations block."""
    from slimkv.kv.contiguous import ContiguousKVManager

    pool = BlockPool(8, enable_caching=False)
    manager = ContiguousKVManager(pool, BS, max_model_len=3 * BS, session_ttl_s=60.0,
                                  num_staging_slots=3)
    assert manager.max_blocks(1) == manager.max_blocks(3 * BS) == 3
    seqs = [Sequence(f"r{i}", [1, 2], SamplingParams(max_tokens=2)) for i in range(3)]
    for seq in seqs[:2]:
        assert manager.can_allocate(seq, 2)
        manager.allocate(seq, 2)
    assert [b.block_id for b in seqs[0].blocks] == [0, 1, 2]
    assert [b.block_id for b in seqs[1].blocks] == [3, 4, 5]
    assert (seqs[0].staging_slot, seqs[1].staging_slot) == (0, 1)
    # Two blocks free, the third needs one block of tokens but reserves three.
    assert not manager.can_allocate(seqs[2], 2)
    assert manager.num_false_oom == 1
    manager.free(seqs[0])
    assert seqs[0].staging_slot is None and pool.num_free_blocks == 5
    assert manager.can_allocate(seqs[2], 2)


def test_prefix_counters_count_each_admission_once_under_memory_pressure():
    """A waiting request that fails can_allocate step after step is looked up each time,
    but counted (queries and hits) once, when it is admitted."""
    sim = Sim(num_blocks=8, budget=64)
    sim.add("a", 5 * BS - 1, max_tokens=4)                  # 5 blocks, 6 while it decodes
    waiter = sim.add("b", 4 * BS, max_tokens=1, base=1000)  # 4 blocks: 3 are free
    for _ in range(4):
        sim.step()
        assert waiter.status is SequenceStatus.WAITING
    sim.run()
    again = sim.add("c", 4 * BS, max_tokens=1, base=1000)   # b's first 3 blocks are cached
    sim.run()
    assert waiter.is_finished and again.num_cached_tokens == 3 * BS
    assert (sim.manager.num_prefix_queries, sim.manager.num_prefix_hits) == (
        (5 * BS - 1) + 4 * BS + 4 * BS, 3 * BS)


def test_watermark_hysteresis_band_keeps_admission_closed():
    """Admission stops at the watermark (0.5) and stays closed until usage falls under
    watermark - hysteresis (0.45), not merely under the watermark."""
    sim = Sim(num_blocks=100, watermark=0.5, budget=64)
    held = sim.pool.get_new_blocks(50)
    waiter = sim.add("w", BS)
    sim.step()
    assert sim.sched.watermark_alert and waiter.status is SequenceStatus.WAITING
    sim.pool.free_blocks(held[47:])                     # usage 0.47: inside the band
    sim.step()
    assert sim.sched.watermark_alert and waiter.status is SequenceStatus.WAITING
    sim.pool.free_blocks(held[40:47])                   # usage 0.40: under it
    sim.step()
    assert not sim.sched.watermark_alert and waiter.status is SequenceStatus.RUNNING


def test_preemption_takes_the_last_admitted_requeues_it_first_and_frees_its_slot():
    sim = Sim(num_blocks=6, budget=64, slots=4)
    a, b, c = (sim.add(r, 2 * BS, max_tokens=4, base=100 * i) for i, r in enumerate("abc"))
    d = sim.add("d", 2 * BS, max_tokens=4, base=300)
    sim.step()                                          # a, b, c fill the pool; d waits
    assert [blk.block_id for s in (a, b, c) for blk in s.blocks] == [0, 1, 2, 3, 4, 5]
    assert [s.staging_slot for s in (a, b, c, d)] == [0, 1, 2, None]
    out = sim.step()                                    # a's decode needs a third block
    assert out.preempted == [c] and [s for s, _ in out.scheduled] == [a, b]
    assert list(sim.sched.waiting) == [c, d] and c.status is SequenceStatus.WAITING
    assert (c.blocks, c.num_computed_tokens, c.staging_slot) == ([], 0, None)
    assert c.num_preemptions == sim.sched.num_preemptions == 1
    # c's blocks went back tail-first (5, then 4): a, scheduled first, takes 5.
    assert [blk.block_id for blk in a.blocks] == [0, 1, 5]
    assert [blk.block_id for blk in b.blocks] == [2, 3, 4]
    assert sim.manager._free_staging[-1] == 2            # c's slot is the next handed out
    sim.run()
    assert all(s.is_finished for s in (a, b, c, d)) and sim.pool.num_free_blocks == 6


def test_free_queue_order_lru_tail_first_and_fifo():
    """lru_block: freed blocks join the queue's end tail-first, so a sequence's head is
    evicted last; fifo: the queue stays in first-allocation order."""
    for evict, expected in (("lru_block", [4, 5, 6, 7, 3, 2, 1, 0]),
                            ("fifo", [4, 5, 6, 7, 0, 1, 2, 3])):
        sim = Sim(num_blocks=8, budget=64, evict=evict)
        seq = sim.add("a", 4 * BS - 1, max_tokens=2)
        sim.step()
        assert [blk.block_id for blk in seq.blocks] == [0, 1, 2, 3]
        assert [blk.block_id for blk in sim.pool.free_queue] == [4, 5, 6, 7]
        sim.run()
        assert seq.is_finished and seq.blocks == []
        assert [blk.block_id for blk in sim.pool.free_queue] == expected, evict
        assert [blk.block_id for blk in sim.pool.get_new_blocks(5)] == expected[:5]


def test_session_head_stays_pinned_until_its_ttl_expires():
    pool = BlockPool(16)
    manager = KVCacheManager(pool, BS, session_ttl_s=10.0)
    seq = Sequence("s1", list(range(3 * BS + 1)), SamplingParams(max_tokens=1), session_id="chat")
    manager.allocate(seq, seq.num_tokens, [])
    seq.num_computed_tokens = seq.num_tokens
    manager.cache_full_blocks(seq)
    head = list(seq.blocks[:3])
    manager.free(seq)
    seen = manager.sessions["chat"].last_seen
    assert [b.session_head for b in head] == ["chat"] * 3
    assert [b.block_id for b in pool.protected] == [0, 1, 2][::-1]
    manager.expire_sessions(now=seen + 9.0)
    assert "chat" in manager.sessions and head[0].session_head == "chat"
    manager.expire_sessions(now=seen + 10.5)
    assert "chat" not in manager.sessions and len(pool.protected) == 0
    assert all(b.session_head is None for b in head)
    assert {b.block_id for b in head} <= {b.block_id for b in pool.free_queue}


def test_slow_lane_block_share_caps_heavy_requests():
    """Heavy requests (over long_request_blocks) run together only while their blocks stay
    under slow_lane_block_share of the pool; a fast request is admitted past them."""
    sim = Sim(num_blocks=40, budget=200, policy="weighted", long_request_blocks=4,
              slow_lane_block_share=0.5)
    s1, s2, s3 = (sim.add(f"s{i}", 30, max_tokens=10, base=100 * i) for i in range(3))
    fast = sim.add("f", BS, max_tokens=2, base=900)
    assert [s.lane for s in (s1, s2, s3, fast)] == ["slow"] * 3 + ["fast"]
    sim.step()
    # 10 blocks each: s1 + s2 = 20 <= 0.5 * 40; s3 would make 30.
    assert s1.status is s2.status is fast.status is SequenceStatus.RUNNING
    assert s3.status is SequenceStatus.WAITING
    while not (s1.is_finished or s2.is_finished):
        sim.step()
        assert s3.status is SequenceStatus.WAITING or s1.is_finished or s2.is_finished
    sim.run()
    assert s3.is_finished
