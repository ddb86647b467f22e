"""How fast this machine streams memory with torch's threads: a 1 GiB float32 buffer reduced
(sum, then max) REPS times each, best GB/s printed. The ceiling a decode-attention kernel
that only waits on its KV reads would run at (its bytes per step / this rate).

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/mem_bandwidth.py [THREADS] [REPS]
"""

from __future__ import annotations

import sys
import time

import torch

GIB = 1 << 30


def best_rate(op, x: torch.Tensor, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        op(x)
        best = min(best, time.perf_counter() - start)
    return x.numel() * x.element_size() / best / 1e9


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else torch.get_num_threads()
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    torch.set_num_threads(threads)
    x = torch.ones(GIB // 4, dtype=torch.float32)
    print(f"{threads} threads, 1 GiB float32: sum {best_rate(torch.sum, x, reps):.1f} GB/s, "
          f"max {best_rate(torch.max, x, reps):.1f} GB/s (best of {reps})")


if __name__ == "__main__":
    main()
