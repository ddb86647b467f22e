"""Where the batched workload's (16 x 512 + 64) step time goes, by part: perf_counter
around each part (monkeypatched wrappers), ms per prefill step (> 64 rows) and per decode
step, mean over one run. Parts nest (indented = inside the one above).

    flock /tmp/slimkv-cpu.lock timeout 200 .venv/bin/python scripts/prof_batched_parts.py int8
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

from slimkv.attention import prefill
from slimkv.attention.paged import PagedAttention
from slimkv.bench.compare import batched, engine_for
from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.kernels.qgemm import QGemm
from slimkv.kernels.step import LeanStep
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging
from slimkv.model.llama import Transformer
from slimkv.model.quant import QuantLinear
from slimkv.engine.runner import ModelRunner
from slimkv.engine.sampling import Sampler
from slimkv.engine.scheduler import Scheduler

PARTS = {"step": (LLMEngine, "step"), " scheduler": (Scheduler, "schedule"),
         " prepare": (ModelRunner, "_prepare"), " model forward": (Transformer, "forward"),
         "  QuantLinear.fused": (QuantLinear, "fused"),
         "   prep (norm/silu -> bf16)": (QGemm, "prep"),
         "   dequantize W -> bf16": (QGemm, "dequantize"),
         "   F.linear (bf16 GEMM)": (F, "linear"),
         "   add_into (residual)": (QGemm, "add_into"),
         "   qgemm kernel (<=64 rows)": (QGemm, "__call__"),
         "  rope": (QGemm, "rope"),
         "  attention": (PagedAttention, "__call__"),
         "   write (staging.append / cache.write)": (PagedAttention, "_write"),
         "   prefill (read_prefix + pieces)": (PagedAttention, "_prefill"),
         "    read_prefix": (PagedKVCache, "read_prefix"),
         "    prefill.run (SDPA pieces)": (prefill, "run"),
         "     SDPA": (prefill, "attend"),
         "   fused decode": (PagedAttention, "_fused_decode"),
         "  one-call decode step (C)": (LeanStep, "_run"),
         " logits": (Transformer, "compute_logits"), " sampler": (Sampler, "__call__")}
TOTAL: dict[str, float] = defaultdict(float)
STEP: dict[str, list[float]] = {"prefill": [], "decode": []}
ROWS = [0]


def timed(name, fn):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            TOTAL[name] += time.perf_counter() - t
    return wrapper


def main() -> None:
    kv = sys.argv[1] if len(sys.argv) > 1 else "int8"
    eng = engine_for(Config.load(), kv, 16, 512 + 64)
    batched(eng, 2, 64, 4)
    for name, (owner, attr) in PARTS.items():
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    fwd = Transformer.forward
    def forward(self, ids, *a, **k):
        ROWS[0] = len(ids)
        return fwd(self, ids, *a, **k)
    Transformer.forward = forward
    per = {"prefill": defaultdict(float), "decode": defaultdict(float)}
    step = LLMEngine.step
    def counted(self):
        TOTAL.clear()
        ROWS[0] = 0
        r = step(self)
        kind = "prefill" if ROWS[0] > 64 else "decode" if ROWS[0] else None
        if kind:
            STEP[kind].append(ROWS[0])
            for n, v in TOTAL.items():
                per[kind][n] += v
        return r
    LLMEngine.step = counted
    print(batched(eng, 16, 512, 64))
    for kind in per:
        n = len(STEP[kind])
        print(f"{kind}: {n} steps, rows {min(STEP[kind])}-{max(STEP[kind])}")
        for name in PARTS:
            if per[kind][name]:
                print(f"  {name:42s} {1000 * per[kind][name] / n:8.1f} ms/step")


if __name__ == "__main__":
    main()
