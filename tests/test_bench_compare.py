"""``slimkv bench compare``: ratio arithmetic, peer skipping, and the workloads on a real engine."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from slimkv.bench import compare
from slimkv.bench.compare import (batched, decode_rate, decode_steps, engine_for,
                                  llamacpp_rows, median_row, prefill_rate, take_turns)
from slimkv.bench.compare_report import TARGETS, ratios, verdicts, vllm_8bit_basis
from slimkv.bench.peers import Peers, root_error
from tests.conftest import small_config


def _slim(step_bf16: float, step_int8: float, step_int4: float) -> dict:
    row = {"batched_16x512_64": {"total_tok_s": 600.0}, "parallel8_tok_s": 300.0,
           "decode_d16_tok_s": 60.0, "decode_d2048_tok_s": 30.0,
           "prefill_512_tok_s": 500.0, "prefill_2048_tok_s": 400.0}
    return {kv: {**row, "decode_step_ms_ctx2048": {"b16": step, "b32": 2 * step}}
            for kv, step in (("bfloat16", step_bf16), ("int8", step_int8), ("int4", step_int4))}


def test_ratios_divide_like_for_like_and_verdicts_follow_the_targets() -> None:
    vllm = {"auto": {"total_tok_s": 400.0}, "fp8": {"total_tok_s": 750.0}}
    llama = {"timing": {"f16": {"decode_128_d16": {"tok_per_s_median": 100.0},
                                "decode_128_d2048": {"tok_per_s_median": 100.0},
                                "prefill_512": {"tok_per_s_median": 1000.0},
                                "prefill_2048": {"tok_per_s_median": 250.0}}},
             "parallel_decode_128": {"f16": {"x8": {"tok_per_s_median": 200.0}}}}
    values = ratios(_slim(10.0, 8.0, 9.0), vllm, llama)
    assert values["batched_bf16_kv_vs_vllm"] == 1.5
    assert values["batched_8bit_kv_vs_vllm"] == 0.8
    assert values["step_int8_over_bf16_b16"] == 0.8 and values["step_int4_over_int8_b32"] == 1.125
    assert values["parallel8_vs_llamacpp"] == 1.5
    assert values["single_decode_d2048_vs_llamacpp"] == 0.3
    assert values["prefill_2048_vs_llamacpp"] == 1.6
    verdict = verdicts(values)
    assert verdict["batched_bf16_kv_vs_vllm"] == "met"          # target 1.5, inclusive
    assert verdict["batched_8bit_kv_vs_vllm"] == "missed"
    assert verdict["step_int8_over_bf16_b16"] == "met"      # lower is better
    assert verdict["step_int4_over_int8_b32"] == "missed"
    assert verdict["single_decode_d2048_vs_llamacpp"] == "missed"   # target 1.0
    assert verdict["prefill_2048_vs_llamacpp"] == "met"             # target 1.5


def test_8bit_row_falls_back_to_vllms_default_kv_only_where_its_fp8_could_not_run() -> None:
    slim = _slim(1.0, 1.0, 1.0)
    failed = {"auto": {"total_tok_s": 400.0}, "fp8": {"skipped": "bench_vllm.py failed"}}
    assert vllm_8bit_basis(failed) == "auto"
    assert ratios(slim, failed, {})["batched_8bit_kv_vs_vllm"] == 1.5
    ran = {"auto": {"total_tok_s": 400.0}, "fp8": {"total_tok_s": 500.0}}
    assert vllm_8bit_basis(ran) == "fp8"
    assert ratios(slim, ran, {})["batched_8bit_kv_vs_vllm"] == 1.2
    assert ratios(slim, {"auto": {"total_tok_s": 400.0}}, {})["batched_8bit_kv_vs_vllm"] is None


def test_a_failed_peer_is_skipped_with_its_root_exception() -> None:
    stderr = ("INFO starting\n(Worker pid=1) ERROR [x.py:10] WorkerProc hit an exception.\n"
              "(Worker pid=1) ERROR [x.py:10] NotImplementedError: FP8 KV cache on CPU requires "
              "x86 with AVX-512 or AMX.\nRuntimeError: Engine core initialization failed.\n")
    assert root_error(stderr) == ("NotImplementedError: FP8 KV cache on CPU requires x86 with "
                                  "AVX-512 or AMX.")
    assert root_error("no exception here\n") == "no exception here"


def test_missing_peers_are_not_measured_rather_than_faked(tmp_path: Path) -> None:
    peers = Peers(scripts=tmp_path, envs=tmp_path)
    assert "skipped" in peers.vllm("auto", 16, 512, 64)
    assert "skipped" in peers.llamacpp(1)
    values = ratios(_slim(1.0, 1.0, 1.0), {}, {})
    assert values["batched_bf16_kv_vs_vllm"] is None
    assert verdicts(values)["parallel8_vs_llamacpp"] == "not measured"
    assert set(verdicts(values)) == set(TARGETS)


@pytest.mark.slow
@pytest.mark.usefixtures("fused_kernel")
def test_workloads_run_on_the_engine_and_leave_the_pool_free() -> None:
    engine = engine_for(small_config(), "int8", max_seqs=4, max_tokens=80)
    total = engine.pool.num_free_blocks
    result = batched(engine, prompts=3, prompt_len=20, new_tokens=4)
    assert result["total_tok_s"] > result["output_tok_s"] > 0
    other = engine_for(small_config(), "bfloat16", max_seqs=4, max_tokens=80)
    steps = decode_steps({"int8": engine, "bfloat16": other}, [2, 4], context=40, steps=2,
                         reps=2)
    for row in steps.values():
        assert set(row) == {"b2", "b4", "b2_runs", "b4_runs"}
        assert len(row["b4_runs"]) == 2
        assert row["b4"] == round(statistics.median(row["b4_runs"]), 2) > 0
    assert not other.has_unfinished() and other.pool.num_free_blocks == total
    assert decode_rate(engine, 2, 8, 4) > 0 and prefill_rate(engine, 30) > 0
    hits = engine.stats().prefix_hits
    assert prefill_rate(engine, 40, seed=1) > 0 and prefill_rate(engine, 40, seed=2) > 0
    assert engine.stats().prefix_hits == hits  # a repetition's prompt is new, not a prefix hit
    assert not engine.has_unfinished() and engine.pool.num_free_blocks == total
    assert engine.stats().attention_paths["fused_decode"] > 0


def test_llamacpp_rows_take_turns_between_engines_run_by_run(monkeypatch) -> None:
    """Each row's runs interleave across the KV dtypes' engines (a drift of the machine falls
    on all of them), prefill prompts differ run by run, and each row is the median."""
    calls: list[tuple] = []

    def rate(engine, *args) -> float:
        calls.append((engine, *args))
        return float(len(calls))  # the run's place in the sitting

    monkeypatch.setattr(compare, "decode_rate", rate)
    monkeypatch.setattr(compare, "prefill_rate", lambda engine, n, seed: rate(engine, n, seed))
    rows = llamacpp_rows({"bf16": "bf16", "int8": "int8"}, 3)
    assert calls[:6] == [(kv, 8, 16, 128) for _ in range(3) for kv in ("bf16", "int8")]
    assert rows["bf16"]["parallel8_tok_s"] == 3.0 and rows["int8"]["parallel8_tok_s"] == 4.0
    prefill = [c for c in calls if c[1:2] == (512,)]
    assert prefill == [(kv, 512, 7919 * r) for r in range(3) for kv in ("bf16", "int8")]
    assert set(rows["int8"]) == {"parallel8_tok_s", "decode_d16_tok_s", "decode_d2048_tok_s",
                                 "prefill_512_tok_s", "prefill_2048_tok_s"}


def test_sides_take_turns_rep_by_rep_and_rows_keep_every_run() -> None:
    order: list[tuple[str, int]] = []
    runs = take_turns(2, {"a": lambda rep: order.append(("a", rep)) or rep,
                          "b": lambda rep: order.append(("b", rep)) or 10 + rep})
    assert order == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert runs == {"a": [0, 1], "b": [10, 11]}
    row = median_row([{"total_tok_s": 3.0, "note": "x"}, {"skipped": "died"},
                      {"total_tok_s": 5.0, "note": "y"}])
    assert row["total_tok_s"] == 4.0 and len(row["runs"]) == 3 and "note" not in row
    assert median_row([{"skipped": "no venv"}] * 2) == {"skipped": "no venv"}
