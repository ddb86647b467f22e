"""Where a single-stream decode step's time goes: perf_counter around each part
(monkeypatched wrappers, ~1 us each), mean ms per step over one compare-bench run
(16-token prompt, 128 new tokens, greedy, default config).

Usage: PYTHONPATH=$PWD python scripts/lean_parts.py [--kv int8] [--reps 2]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from slimkv.attention.paged import PagedAttention
from slimkv.bench.compare import decode_rate, engine_for, prefill_rate
from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.kernels import DecodeKernel
from slimkv.kernels.qgemm import QGemm
from slimkv.kernels.step import LeanStep
from slimkv.kernels.stage import StageKernel
from slimkv.model.llama import RMSNorm, Transformer
from slimkv.model.quant import QuantEmbedding, QuantLinear
from slimkv.engine.outputs import Detokenizer
from slimkv.engine.runner import ModelRunner
from slimkv.engine.sampling import Sampler
from slimkv.engine.scheduler import Scheduler

PARTS = {"step (engine.step)": (LLMEngine, "step"), "runner.execute": (ModelRunner, "execute"),
         "prepare (metadata)": (ModelRunner, "_prepare"), "model forward": (Transformer, "forward"),
         "LM head (compute_logits)": (Transformer, "compute_logits"),
         "QuantLinear.fused (all, incl. kernel)": (QuantLinear, "fused"),
         "qgemm C call + QGemm wrapper": (QGemm, "__call__"), "RoPE (C)": (QGemm, "rope"),
         "attention (all)": (PagedAttention, "__call__"),
         "attention kernel call + wrapper": (DecodeKernel, "__call__"),
         "KV stage call + wrapper": (StageKernel, "__call__"),
         "embedding": (QuantEmbedding, "forward"), "final norm": (RMSNorm, "forward"),
         "sampler": (Sampler, "__call__"),
         "one-call step (LeanStep._run, incl. C)": (LeanStep, "_run"),
         "  its filled blocks + path counts": (PagedAttention, "after_lean_step"),
         "scheduler": (Scheduler, "schedule"), "detokenizer": (Detokenizer, "update")}
TOTALS: dict[str, float] = defaultdict(float)


def timed(name: str, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TOTALS[name] += time.perf_counter() - start
    return wrapper


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="int8")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    engine = engine_for(Config.load(), args.kv, 8, 2400)
    prefill_rate(engine, 16)
    for name, (cls, attr) in PARTS.items():
        setattr(cls, attr, timed(name, getattr(cls, attr)))
    for _ in range(args.reps):
        TOTALS.clear()
        steps = 129  # one prefill step + 128 decode steps; the prefill is ~1 step's cost
        wall = time.perf_counter()
        rate = decode_rate(engine, 1, 16, 128)
        wall = time.perf_counter() - wall
        print(f"{rate:.2f} tok/s ({1000 / rate:.2f} ms/step untimed-equivalent); "
              f"wall {1000 * wall / steps:.2f} ms/step incl. prefill")
        for name in PARTS:
            print(f"  {name:40s} {1000 * TOTALS[name] / steps:7.3f} ms/step")


if __name__ == "__main__":
    main()
