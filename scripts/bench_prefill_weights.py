"""The GEMM path of a prefill chunk's 120 projections (SmolLM2-135M's Q4_1 layer shapes, 30
layers): dequantizing the packed weights (qgemm.c ``qdequant``) and the float GEMM over them,
in the model dtype ``auto`` picks here (or the one named), best of 5 per shape. Random
codes: speed only.

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/bench_prefill_weights.py [ROWS ...]
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_qgemm_step import LAYERS, SHAPES, best_ms, random_weight  # noqa: E402

from slimkv.kernels.qgemm import pack, qgemm_kernel  # noqa: E402
from slimkv.engine.runner import resolve_dtype  # noqa: E402


def main(rows: list[int], dtype: torch.dtype) -> None:
    torch.set_num_threads(2)
    kernel = qgemm_kernel()
    weights = [(pack(w.q, w.d, w.m, w.bits), n) for n, k, bits in SHAPES
               for w in [random_weight(n, k, bits)]]
    print(f"dtype {dtype}; ms per chunk (x {LAYERS} layers)")
    print("rows  dequantize_ms  gemm_ms")
    for m in rows:
        deq = gemm = 0.0
        for packed, n in weights:
            dense = kernel.dequantize(packed, n, dtype)
            x = torch.randn(m, dense.shape[1]).to(dtype)
            deq += best_ms(lambda _: kernel.dequantize(packed, n, dtype), m) * LAYERS
            gemm += best_ms(lambda _: F.linear(x, dense), m) * LAYERS
        print(f"{m:4d} {deq:14.1f} {gemm:8.1f}", flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    names = [a for a in args if not a.isdigit()]
    main([int(a) for a in args if a.isdigit()] or [512],
         resolve_dtype(names[0] if names else "auto", torch.device("cpu")))
