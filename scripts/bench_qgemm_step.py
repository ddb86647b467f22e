"""One decode step's matmuls at 1-32 rows: the int8 dot-product kernel (int8 activations,
and PRECISE: int8 + int8 residual), dequantize + GEMM, and bf16-resident weights (reference), with SmolLM2-135M's shapes (30 layers of Q4_1
QKV / O / gate-up / down, the Q8_0 49,152 x 576 head). Random codes: speed only.

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/bench_qgemm_step.py [ROWS ...]
"""

from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

from slimkv.kernels.qgemm import PLAIN, PRECISE, pack, qgemm_kernel
from slimkv.model.quant import QuantTensor

HIDDEN, FFN, LAYERS, VOCAB = 576, 1536, 30, 49152
SHAPES = [(960, HIDDEN, 4), (HIDDEN, HIDDEN, 4), (2 * FFN, HIDDEN, 4), (HIDDEN, FFN, 4)]


def random_weight(n: int, k: int, bits: int) -> QuantTensor:
    q = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8)
    d = (torch.rand(n, k // 32) * 0.01).half()
    return QuantTensor(q, d, (-8 * d).half(), bits)


def main(rows: list[int]) -> None:
    torch.set_num_threads(2)
    kernel = qgemm_kernel()
    quant = [random_weight(n, k, b) for _ in range(LAYERS) for n, k, b in SHAPES]
    quant.append(random_weight(VOCAB, HIDDEN, 8))
    packed = [(pack(w.q, w.d, w.m, w.bits), w.shape[0], w.shape[1]) for w in quant]
    floats = [torch.randn(w.shape).bfloat16() for w in quant]
    x = {k: torch.randn(64, k) for k in (HIDDEN, FFN)}

    def step_kernel(m: int, mode: int = PLAIN) -> None:
        for p, n, k in packed:
            kernel(x[k][:m], p, n, mode=mode)

    def step_precise(m: int) -> None:
        step_kernel(m, PRECISE)

    def step_dequant(m: int) -> None:
        for p, n, k in packed:
            dense = kernel.dequantize(p, n, torch.bfloat16)
            F.linear(x[k][:m].bfloat16(), dense).float()

    def step_bf16(m: int) -> None:
        for w in floats:
            F.linear(x[w.shape[1]][:m].bfloat16(), w).float()

    print("rows  kernel_ms  precise_ms  dequant+gemm_ms  bf16_resident_ms")
    for m in rows:
        ms = [best_ms(fn, m) for fn in (step_kernel, step_precise, step_dequant, step_bf16)]
        print(f"{m:4d} {ms[0]:10.1f} {ms[1]:11.1f} {ms[2]:16.1f} {ms[3]:17.1f}", flush=True)


def best_ms(fn, m: int, reps: int = 5) -> float:
    fn(m)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn(m)
        best = min(best, time.perf_counter() - start)
    return best * 1e3


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [1, 2, 4, 8, 16, 32])
