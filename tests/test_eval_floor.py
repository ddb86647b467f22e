"""Issue 46 through the real engine on the embedded model: scoring only a window's last
positions, the floor run (the reference prefilled in other chunks: ~zero in float32
activations, not in bf16), and a tiny stats-suite run's intervals and McNemar counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slimkv.config import Config
from slimkv.eval import corpus
from slimkv.eval.harness import SUITES, eval_config, run_eval
from slimkv.eval.perplexity import TokenStats, next_token_logprobs
from slimkv.eval.report import markdown, to_json
from slimkv.llm import LLM
from slimkv.model.quant import QuantLinear

pytestmark = pytest.mark.slow


def _config(dtype: str) -> Config:
    return Config.load().replace("model", device="cpu", dtype=dtype)


def _window(llm: LLM, size: int) -> list[int]:
    return corpus.windows(llm.tokenizer, size, 1)[0]


def test_score_last_returns_the_last_rows_of_the_full_scoring() -> None:
    llm = LLM(eval_config(_config("float32"), "float32", 512))
    ids = _window(llm, 300)
    full = llm.engine.score(ids, chunk=64)
    for last in (1, 40, 64, 100, 300):
        part = llm.engine.score(ids, chunk=64, last=last)
        assert part.shape == (last, full.shape[1])
        torch.testing.assert_close(part, full[-last:], atol=1e-4, rtol=1e-4)


def _floor_stats(dtype: str) -> TokenStats:
    """One 512-token window: the plain run (one prefill pass) against dtype@chunk=64."""
    ref = LLM(eval_config(_config(dtype), dtype, 512))
    floor = LLM(eval_config(_config(dtype), f"{dtype}@chunk=64", 512))
    assert floor.engine.config.scheduler.max_num_batched_tokens == 64
    ids = _window(ref, 512)
    lp_ref = next_token_logprobs(ref.engine.score(ids))
    stats = TokenStats()
    stats.add(next_token_logprobs(floor.engine.score(ids)), torch.tensor(ids[1:]), lp_ref)
    return stats


def _bf16_projections_round_by_rows() -> bool:
    """Whether a bf16 model's projections (each of layer 0's, and the logits, through the
    model's own modules: bucketed oneDNN GEMMs, or AMX tiles) give a row other bits at 64 rows
    than at 512: what can make a prefill in 64-token chunks differ from one pass. Its
    attention cannot: a chunk's staged pieces walk the same 64-key blocks in both
    (tests/test_prefill_pieces.py)."""
    model = LLM(eval_config(_config("bfloat16"), "bfloat16", 512)).engine.runner.model
    gen = torch.Generator().manual_seed(0)
    projections = [m for m in model.layers[0].modules()
                   if isinstance(m, (torch.nn.Linear, QuantLinear))]
    assert len(projections) >= 4, projections  # qkv, o, gate-up, down: the layer's found
    for run, width in [*((m, m.in_features) for m in projections),
                       (model.compute_logits, model.norm.weight.shape[0])]:
        x = torch.randn(512, width, generator=gen).bfloat16()
        if not torch.equal(run(x), torch.cat([run(x[i:i + 64]) for i in range(0, 512, 64)])):
            return True
    return False


def test_floor_is_near_zero_in_float32_and_not_in_bf16() -> None:
    """float32's floor is ~0. bf16's is well above it where the CPU's bf16 projections
    round a row differently by how many rows they get (AMX tiles, torch's bf16 GEMM without
    native bf16), and exactly 0 where they do not (AVX512-BF16 without AMX): the chunked run
    is then the one pass bit for bit."""
    f32, bf16 = _floor_stats("float32"), _floor_stats("bfloat16")
    print(f"\nfloor KL float32 {f32.mean_kl:.3g} top-1 {f32.top1_agreement:.4f}; "
          f"bf16 KL {bf16.mean_kl:.3g} top-1 {bf16.top1_agreement:.4f}")
    assert f32.mean_kl < 1e-7 and f32.top1_agreement > 0.998
    if _bf16_projections_round_by_rows():
        assert bf16.mean_kl > 100 * max(f32.mean_kl, 1e-9)
    else:
        assert bf16.mean_kl == 0.0 and bf16.top1_agreement == 1.0


def test_a_tiny_stats_run_reports_intervals_and_mcnemar() -> None:
    suite = dataclasses.replace(SUITES["stats"], num_windows=3, keys_per_cell=2, window=256,
                                passkey_contexts=(256,), placements=("block0", "edge16"),
                                depths=(1.0,))  # the stats suite's machinery at 256 tokens
    ev = run_eval(_config("float32"), ["float32"], suite, progress=False)
    assert [run.dtype for run in ev.runs] == ["float32@chunk=64", "float32"]
    assert ev.floor is ev.runs[0] and len(ev.reference.windows) == 3
    assert ev.reference.stats.tokens == sum(w.tokens for w in ev.reference.windows)
    out = to_json(ev, ["float32"], 1.0)
    same = out["dtypes"]["float32"]
    assert all(v == {"value": 0, "low": 0, "high": 0} for k, v in same["intervals"].items()
               if k != "top1_agreement")
    assert same["mcnemar"]["passkey"] == {"b": 0, "c": 0, "p": 1.0}
    assert sum(c["keys"] for c in same["passkey_cells"].values()) == 6
    assert same["above_floor"] is not None
    assert out["dtypes"]["float32@chunk=64"]["above_floor"] is None
    assert out["floor"] == "float32@chunk=64" and out["windows"] == 3
    assert "+0.00% [+0.00, +0.00]" in markdown(ev)
