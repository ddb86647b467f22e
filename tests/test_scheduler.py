"""Scheduler and KV manager on the CPU, without a model: a tiny simulator plays the
engine's part (computed tokens advance, a caught-up sequence emits one token)."""


from slimkv.config import KVCacheConfig, SchedulerConfig
from slimkv.kv.block_pool import BlockPool
from slimkv.kv.manager import KVCacheManager
from slimkv.sampling import SamplingParams
from slimkv.scheduler import Scheduler
from slimkv.sequence import Sequence, SequenceStatus

BS = 4


class Sim:
    def __init__(self, num_blocks=64, budget=32, soft=48, watermark=1.0, policy="fcfs",
                 evict="lru_block", **sched):
        self.pool = BlockPool(num_blocks, evict_policy=evict)
        kv = KVCacheConfig(block_size=BS, max_concurrency_soft=soft, watermark=watermark,
                           num_blocks=num_blocks)
        self.manager = KVCacheManager(self.pool, BS, session_ttl_s=kv.session_ttl_s)
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
