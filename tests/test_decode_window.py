"""``slimkv bench engine``'s decode window (slimkv/bench/decode_window.py) on a real engine
(a random 2-layer Llama on the CPU) whose prefill spans many steps: the timed steps are
exactly the full-batch decode steps after the last prefill step, as a log of every step's
work per sequence (taken independently of the window's own bookkeeping) shows; and
``bench_engine`` drops each engine before it builds the next and reports after each dtype."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from slimkv.bench import engine as bench
from slimkv.bench.decode_window import decode_window, prefill_all, prefill_steps_bound
from slimkv.config import Config
from slimkv.engine.sampling_params import SamplingParams
from slimkv.plugins import build_engine
from slimkv.workload import random_prompt
from test_cuda import write_checkpoint

BATCH, CONTEXT, BUDGET = 4, 40, 32  # 160 prompt tokens at 32 a step: prefill over 5+ steps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("tiny-llama"))


def config(path: Path) -> Config:
    return Config.from_dict({"model": {"path": str(path), "device": "cpu", "dtype": "float32"},
                             "kv_cache": {"dtype": "int8", "memory_gb": 0.02,
                                          "enable_prefix_caching": False},
                             "scheduler": {"max_num_batched_tokens": BUDGET}})


def logged(engine) -> list[list[tuple[int, int]]]:
    """Wrap ``engine.step`` to log, per step, each live sequence's (tokens computed, tokens
    sampled) in it; returns the log."""
    log, step = [], engine.step

    def logging_step():
        seqs = list(engine.requests.values())
        before = [(s.num_computed_tokens, s.num_output_tokens) for s in seqs]
        out = step()
        log.append([(s.num_computed_tokens - c, s.num_output_tokens - o)
                    for s, (c, o) in zip(seqs, before)])
        return out

    engine.step = logging_step
    return log


def start(engine, max_tokens: int) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [engine.add_request(random_prompt(CONTEXT, engine.model_args.vocab_size, seed=i),
                               params) for i in range(BATCH)]


def test_window_holds_only_full_batch_decode_steps(checkpoint: Path) -> None:
    engine = build_engine(config(checkpoint))
    log = logged(engine)
    seqs = start(engine, 6 + prefill_steps_bound(BATCH, CONTEXT, BUDGET))
    prefill = prefill_all(engine, seqs)
    # The prefill spanned several steps, and in them the first sequences already decoded.
    assert prefill >= 5 and max(s.num_output_tokens for s in seqs) > 1
    assert any(w.count((1, 1)) for w in log[:prefill])
    window = decode_window(engine, seqs, 6)
    assert (window.steps, window.tokens) == (6, 6 * BATCH) and window.seconds > 0
    assert log[prefill:] == [[(1, 1)] * BATCH] * 6  # every timed step: all B decode once
    assert any(c > 1 for w in log[:prefill] for c, _ in w)  # prefill chunks came before


def test_window_ends_before_a_finished_sequence_leaves_the_batch(checkpoint: Path) -> None:
    """``max_tokens`` leaves no room for what the leader decoded during the others' prefill:
    it finishes before the 20 steps asked for; the window stops with it and counts the
    tokens of its full steps only."""
    engine = build_engine(config(checkpoint))
    log = logged(engine)
    seqs = start(engine, 20)
    prefill = prefill_all(engine, seqs)
    most = max(s.num_output_tokens for s in seqs)
    assert 1 < most < 20  # the leader finishes inside the 20 steps asked for
    window = decode_window(engine, seqs, 20)
    full = 0
    for w in log[prefill:]:
        if len(w) != BATCH or w != [(1, 1)] * BATCH:
            break
        full += 1
    assert window.steps == full == 20 - most and window.tokens == BATCH * full
    assert any(s.is_finished for s in seqs)


def test_measure_decode_times_new_tokens_full_steps_and_cleans_up(checkpoint: Path) -> None:
    engine = build_engine(config(checkpoint))
    log = logged(engine)
    window, peak = bench.measure_decode(engine, BATCH, CONTEXT, 5)
    assert (window.steps, window.tokens, peak) == (5, 5 * BATCH, None)
    assert not engine.has_unfinished() and [[(1, 1)] * BATCH] * 5 in \
        [log[i:i + 5] for i in range(len(log))]


def test_bench_engine_frees_each_engine_and_reports_each_dtype(checkpoint: Path,
                                                               monkeypatch) -> None:
    from slimkv.kernels.triton.pool import TritonPoolWriter

    built: list[weakref.ref] = []
    alive_at_build: list[bool] = []

    def build(cfg):
        alive_at_build.append(any(ref() is not None for ref in built))
        engine = build_engine(cfg)
        cache = engine.runner.cache
        cache.writer = TritonPoolWriter(cache)  # the CUDA engine's cache <-> writer pair
        built.extend([weakref.ref(engine), weakref.ref(cache)])
        return engine

    monkeypatch.setattr(bench, "build_engine", build)
    reports: list[list[str]] = []
    result = bench.bench_engine(config(checkpoint), ["bfloat16", "int8"], [16], [BATCH],
                                CONTEXT, 3, on_result=lambda r: reports.append(list(r["results"])))
    assert alive_at_build == [False, False] and reports == [["bfloat16"], ["bfloat16", "int8"]]
    gc.collect()
    assert all(ref() is None for ref in built)
    for row in result["results"].values():
        assert row[f"decode_b{BATCH}_ctx{CONTEXT}_steps"] == 3
        assert row[f"decode_b{BATCH}_ctx{CONTEXT}_tok_s"] > 0
