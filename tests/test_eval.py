"""The accuracy harness on the embedded model through the real engine: the quick suite,
regressions against float32 KV, the gate, and the int8/int4 accuracy bounds."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import slimkv.config
import slimkv.kv.layers
from slimkv.config import Config
from slimkv.eval.harness import SUITES, DtypeRun, EvalRun, run_eval
from slimkv.eval.report import gate, metrics, regressions, text_table, to_json
from slimkv.kv.quant import Int4Codec, KVCodec, make_codec

pytestmark = pytest.mark.slow
BROKEN = "int2_test_only"


class Int2Codec(Int4Codec):
    """A deliberately broken KV dtype for the gate test: 4 levels per group of 32."""

    QMAX = 3


def _make_codec(name: str, head_dim: int, group_size: int = 32) -> KVCodec:
    return Int2Codec(name, head_dim, group_size) if name == BROKEN else make_codec(name, head_dim,
                                                                                 group_size)


@pytest.fixture(scope="module")
def quick() -> Iterator[EvalRun]:
    """The quick suite for float32 (a second, independent run of the reference), int8,
    int4 and the broken 2-bit dtype, registered for this module only."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(slimkv.config, "KV_DTYPES", (*slimkv.config.KV_DTYPES, BROKEN))
        mp.setattr(slimkv.kv.layers, "make_codec", _make_codec)
        config = Config.load().replace("model", device="cpu", dtype="float32")
        ev = run_eval(config, ["float32", "int8", "int4", BROKEN], SUITES["quick"],
                      progress=False)
        print("\n" + text_table(ev))       # the measured table, for the CI log
        yield ev


def _run(ev: EvalRun, dtype: str) -> DtypeRun:
    return next(run for run in ev.runs if run.dtype == dtype)


def test_quick_suite_runs_and_reference_answers_its_tasks(quick: EvalRun) -> None:
    assert quick.corpus_tokens >= 2000
    ref = metrics(quick.reference, quick)
    assert 1 < ref["perplexity"] < 100
    for task in ("passkey", "head_recall", "multi_turn"):
        assert ref[task] is not None and ref[task] >= 50, (task, ref[task])


def test_float32_against_float32_shows_zero_regression(quick: EvalRun) -> None:
    run = _run(quick, "float32")
    m = metrics(run, quick)
    assert m["kl"] == 0 and m["top1_agreement"] == 100
    assert all(value == 0 for value in regressions(run, quick).values())
    assert run.outputs == quick.reference.outputs


def test_int4_regresses_more_than_int8(quick: EvalRun) -> None:
    int8, int4 = metrics(_run(quick, "int8"), quick), metrics(_run(quick, "int4"), quick)
    assert int4["perplexity"] > int8["perplexity"]
    assert int4["kl"] > int8["kl"]


def test_int8_perplexity_and_top1_against_float32(quick: EvalRun) -> None:
    """Core-engine bound: over >= 2,000 tokens, int8 KV perplexity within 0.3% of float32
    KV's and top-1 agreement >= 97%; int4 measurably worse than int8."""
    int8 = _run(quick, "int8")
    assert int8.stats.tokens >= 2000
    assert abs(regressions(int8, quick)["perplexity"]) <= 0.3
    assert metrics(int8, quick)["top1_agreement"] >= 97
    assert regressions(_run(quick, "int4"), quick)["perplexity"] > 2 * max(
        regressions(int8, quick)["perplexity"], 0.1)


def test_gate_passes_int8_and_fails_a_broken_dtype(quick: EvalRun) -> None:
    assert gate(quick, ["int8"], 1.0) == []
    assert to_json(quick, ["int8"], 1.0)["gate"]["passed"]
    failures = gate(quick, ["int8", BROKEN], 1.0)
    assert failures and {f.dtype for f in failures} == {BROKEN}
    assert "perplexity" in {f.metric for f in failures}
    assert not to_json(quick, ["int8", BROKEN], 1.0)["gate"]["passed"]
