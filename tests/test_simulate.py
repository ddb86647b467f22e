"""The simulator is pinned to the real engine: on the same workload the real ``LLMEngine``
(the embedded model) and ``SimEngine`` (no model, a step-time model) make the same
decisions at every step: who is admitted, preempted and finished, and how many tokens run.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from slimkv.config import Config
from slimkv.kv.block_pool import BlockPool
from slimkv.kv.manager import KVCacheManager
from slimkv.engine.sampling_params import SamplingParams
from slimkv.engine.sequence import Sequence
from slimkv.plugins import build_engine
from slimkv.simulate.engine import Batch, SimEngine, StepRecord


def workload(seed: int = 0) -> list[tuple[int, str, list[int], int, str | None]]:
    """(arrival step, request id, prompt ids, max_tokens, session): shared prefixes (a
    session's later turns repeat its first), a long request for the slow lane, bursts."""
    rng = random.Random(seed)
    shared = [rng.randrange(300, 40000) for _ in range(40)]
    out = []
    for i in range(14):
        head = shared if i % 3 == 0 else [rng.randrange(300, 40000) for _ in range(24)]
        tail = [rng.randrange(300, 40000) for _ in range(rng.randrange(5, 60))]
        out.append((i // 3 * 2, f"r{i}", head + tail, rng.randrange(23, 32),
                    f"s{i % 4}" if i % 2 else None))
    out.append((3, "long", [rng.randrange(300, 40000) for _ in range(300)], 6, None))
    return sorted(out)


def config(paged: bool, **sched) -> Config:
    # model.dtype stays auto: no decision depends on the logits (greedy, ignore_eos, fixed
    # max_tokens), and float32's dense weights made the engine side 5x slower on bf16 CPUs.
    return (Config()
            .replace("model", max_model_len=512)
            .replace("kv_cache", dtype="bfloat16", paged=paged, num_blocks=24 if paged else 48,
                     max_concurrency_soft=5, watermark=0.9)
            .replace("scheduler", max_num_batched_tokens=96, long_request_blocks=16, **sched))


def decisions_real(cfg: Config) -> list[tuple]:
    engine = build_engine(cfg)
    sched = engine.scheduler
    trace, pending = [], workload()
    while pending or engine.has_unfinished():
        while pending and pending[0][0] <= engine.num_steps:
            _, rid, ids, n, session = pending.pop(0)
            engine.add_request(ids, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                               rid, session)
        schedule, captured = sched.schedule, {}

        def spy():
            before = {id(s) for s in sched.running}
            captured["out"] = out = schedule()
            captured["admitted"] = [s.request_id for s in sched.running if id(s) not in before]
            return out

        sched.schedule = spy
        outputs = engine.step()
        sched.schedule = schedule
        out = captured["out"]
        trace.append((engine.num_steps, sorted(captured["admitted"]),
                      sorted(s.request_id for s in out.preempted),
                      sorted(o.request_id for o in outputs if o.finished), out.num_tokens))
        assert engine.num_steps < 2000
    return trace


def sim_engine(cfg: Config, max_model_len: int | None) -> SimEngine:
    return SimEngine(cfg.kv_cache, cfg.scheduler, cfg.kv_cache.num_blocks, max_model_len,
                     lambda b: 0.01 + 0.001 * b.num_tokens)


def replay(sim: SimEngine, row: Callable[[StepRecord], tuple]) -> list[tuple]:
    """Run the workload on ``sim`` (each request at its step), one ``row`` per step."""
    trace, pending = [], workload()
    while pending or sim.has_unfinished():
        while pending and pending[0][0] <= sim.num_steps:
            _, rid, ids, n, session = pending.pop(0)
            sim.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), rid, session)
        record, _ = sim.step()
        trace.append(row(record))
    return trace


def decisions_sim(cfg: Config) -> list[tuple]:
    return replay(sim_engine(cfg, cfg.model.max_model_len),
                  lambda r: (r.step, sorted(r.admitted), sorted(r.preempted),
                             sorted(r.finished), r.num_tokens))


@pytest.mark.slow
@pytest.mark.parametrize("paged,policy", [(True, "weighted"), (True, "fcfs"),
                                          (False, "weighted")])
def test_same_decisions_as_the_engine_step_by_step(paged, policy):
    cfg = config(paged, policy=policy)
    real, sim = decisions_real(cfg), decisions_sim(cfg)
    assert len(real) == len(sim)
    for a, b in zip(real, sim):
        assert a == b, f"step {a[0]}: engine {a} vs simulator {b}"
    # Every request finished; the paged runs preempted on the way.
    assert sum(len(t[3]) for t in real) == len(workload())
    assert not paged or sum(len(t[2]) for t in real) > 0


def test_the_workload_preempts_and_hits_the_prefix_cache():
    """The shared workload is tight enough that the pinned traces cover preemption and
    prefix hits (checked on the simulator alone, which is what is fast)."""
    cfg = config(True, policy="weighted")
    sim = SimEngine(cfg.kv_cache, cfg.scheduler, cfg.kv_cache.num_blocks, 512, lambda b: 0.01)
    pending = workload()
    while pending or sim.has_unfinished():
        while pending and pending[0][0] <= sim.num_steps:
            _, rid, ids, n, session = pending.pop(0)
            sim.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), rid, session)
        sim.step()
    assert sim.manager.num_prefix_hits > 0 and sim.scheduler.num_preemptions > 0
    assert sim.pool.num_free_blocks == sim.pool.num_blocks


def test_skipping_session_expiry_scans_changes_nothing():
    """The simulator scans sessions for expiry only once the oldest could be past its TTL;
    against a scan every step (what the engine does), the same decisions, the same
    protected blocks and the same sessions at every step, with sessions expiring."""
    cfg = config(True, policy="weighted").replace("kv_cache", session_ttl_s=0.3)

    def trace(every_step: bool) -> list[tuple]:
        sim = sim_engine(cfg, 512)
        if every_step:
            sim._expire_sessions = sim.manager.expire_sessions
        return replay(sim, lambda r: (r.admitted, r.preempted, r.finished, r.num_tokens,
                                      len(sim.pool.protected), sorted(sim.manager.sessions)))

    every, gated = trace(True), trace(False)
    assert every == gated
    seen = [set(t[5]) for t in every]
    assert any(a - b for a, b in zip(seen, seen[1:]))    # some session did expire


def test_a_full_block_is_offered_to_the_prefix_index_once():
    pool = BlockPool(16)
    manager = KVCacheManager(pool, 4, session_ttl_s=600.0)
    offered = []
    cache_block = pool.cache_block
    pool.cache_block = lambda block, h: (offered.append(block.block_id), cache_block(block, h))
    seq = Sequence("a", list(range(300, 310)), SamplingParams(max_tokens=8))
    for n in (6, 1, 1, 1, 1):       # a chunk, then decode steps
        manager.allocate(seq, n)
        seq.num_computed_tokens += n
        seq.token_ids.append(999)
        manager.cache_full_blocks(seq)
    assert sorted(offered) == sorted(set(offered))
    assert len(offered) == seq.num_computed_tokens // 4


def test_batch_reports_context_before_the_new_tokens():
    seen: list[Batch] = []
    cfg = config(True)
    sim = SimEngine(cfg.kv_cache, cfg.scheduler, 48, 512, lambda b: seen.append(b) or 0.02)
    sim.add_request(list(range(300, 340)), SamplingParams(max_tokens=2, ignore_eos=True))
    sim.step()
    sim.step()
    assert seen[0].new_tokens == (40,) and seen[0].context == (0,) and seen[0].num_sampled == 1
    assert seen[1].new_tokens == (1,) and seen[1].context == (40,)
    assert sim.now == pytest.approx(0.04)


# -- step-time model, card, fleet ---------------------------------------------------------

def test_decode_step_is_the_weights_and_kv_over_the_bandwidth():
    """A batch of one decode token on an A100: the roofline is memory-bound, so the step
    is the weights plus the KV context read at the stated bandwidth efficiency."""
    from slimkv.simulate.card import Card, Variant
    from slimkv.simulate.costs import GPU_DEFAULTS, device

    dev = device("A100-80GB")
    card = Card.build("llama-2-7b", dev, Variant("bfloat16"), 4096)
    ctx = 1000
    kv = ctx + 1
    per_token = 2 * 32 * 4096 * 2                      # K and V, 32 layers, bf16
    expect = (GPU_DEFAULTS["overhead_s"] + GPU_DEFAULTS["per_seq_s"]
              + (card.weight_bytes + kv * per_token) / (dev.hbm_gbps * 1e9 * dev.bw_eff))
    assert card.step_model(Batch((1,), (ctx,), 1)) == pytest.approx(expect)
    # A 2048-token prefill chunk is compute-bound: ~2 FLOPs per parameter per token.
    prefill = card.step_model(Batch((2048,), (0,), 1))
    assert prefill > 2 * 6.5e9 * 2048 / (dev.bf16_tflops * 1e12 * dev.flop_eff)


def test_card_pool_is_the_planners():
    from slimkv.planner import plan
    from slimkv.simulate.card import Card, Variant
    from slimkv.simulate.costs import device

    dev = device("A100-80GB")
    for dtype in ("bfloat16", "int8", "int4"):
        card = Card.build("qwen2.5-7b", dev, Variant(dtype), 4096, soft=48)
        p = plan("qwen2.5-7b", dev.memory_bytes, context=4096, sessions=48, kv_dtypes=(dtype,))
        assert card.num_blocks == p.rows[0].num_blocks and card.kv_budget == p.kv_budget


def test_fleet_rows_merge_by_variant_load_and_cards():
    from slimkv.simulate.fleet import merge_rows

    meta = dict(model="m", device="d", think_time=30.0, duration=300.0, warmup=60.0, slo_s=5.0)
    row = lambda v, n, c, p99: {"variant": v, "sessions": n, "cards": c, "p99": p99}  # noqa: E731
    old = {**meta, "rows": [row("int8", 1000, 9, 1.0), row("bf16", 1000, 20, 2.0)]}
    new = {**meta, "rows": [row("int8", 1000, 9, 3.0), row("int8", 10000, 90, 4.0)]}
    merged = merge_rows(old, new)["rows"]
    assert [(r["variant"], r["sessions"], r["p99"]) for r in merged] == [
        ("bf16", 1000, 2.0), ("int8", 1000, 3.0), ("int8", 10000, 4.0)]
    assert merge_rows({**old, "think_time": 10.0}, new) == new   # another workload: replaced


def test_case_pieces_merge_in_variant_order():
    from slimkv.simulate.capacity import merge_case

    spec = {"model": "m", "levels": [8, 16]}
    v = lambda name, n: {"variant": name, "sessions_served": n}  # noqa: E731
    a = merge_case(None, {"spec": spec, "command": "a", "elapsed_s": 1.0,
                          "variants": [v("int8 paged", 40)], "policies": []})
    b = {"spec": spec, "command": "b", "elapsed_s": 2.0, "policies": [{"policy": "p"}],
         "variants": [v("bf16 contiguous", 20), v("int8 paged", 41)]}
    m = merge_case(a, b)
    assert [(x["variant"], x["sessions_served"]) for x in m["variants"]] == [
        ("bf16 contiguous", 20), ("int8 paged", 41)]
    assert m["policies"] == [{"policy": "p"}] and m["elapsed_s"] == 3.0
    assert [p["command"] for p in m["pieces"]] == ["a", "b"]
    assert merge_case(a, {**b, "spec": {**spec, "levels": [8]}})["pieces"] == [
        {"command": "b", "elapsed_s": 2.0}]          # another spec: starts over


def test_fleet_keeps_sessions_home_and_finishes_turns():
    from slimkv.simulate.card import Card, Variant
    from slimkv.simulate.costs import device
    from slimkv.simulate.fleet import run_fleet
    from slimkv.simulate.workload import SessionSpec

    card = Card.build("llama-2-7b", device("A100-80GB"), Variant("int8"), 1024)
    result = run_fleet(card, 3, SessionSpec(1024, 512, 32, think_time=2.0), 30, 40.0, 5.0)
    assert result["turns_done"] > 30
    assert set(result["route_reasons"]) <= {"session", "load", "kv"}
    assert result["route_reasons"]["session"] > 0.9 * sum(result["route_reasons"].values())
