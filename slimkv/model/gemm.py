"""Float matmuls whose row counts fall into a few buckets, so a long-running server's memory
stays flat.

On a CPU with native bf16, torch runs bf16 matmuls in oneDNN, which JIT-compiles kernels for
every new shape and keeps them (its cache holds 1,024). A server's prefill steps take every
row count up to the chunk, so its resident memory grew ~40 MiB a minute for as long as new
counts came: +17.4% in ten minutes of overload (``slimkv bench soak``, docs/soak.md). So past
``EXACT_ROWS`` rows, a CPU GEMM's input is padded with zero rows up to a multiple of
``ROW_BUCKET`` and the extra output rows dropped: rows are independent, so the kept rows are
the same sums (bit-identical where measured). ``slimkv bench kernels --parts rows`` (Zen 4,
SmolLM2's four projections at every count 65-512): 1,792 shapes added 1,086 MiB, the buckets'
112 shapes 85 MiB; the padding costs 3% where both are cached. float32 (MKL) and fp16 on a
CPU without native fp16 stayed flat either way; fp16 is bucketed too for CPUs that have it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

EXACT_ROWS = 16    # up to here a GEMM is memory-bound and each count is its own shape
ROW_BUCKET = 16    # past it, rows padded up to a multiple of this
JIT_DTYPES = (torch.bfloat16, torch.float16)


def bucket_rows(rows: int) -> int:
    """The row count a GEMM of ``rows`` rows runs at."""
    return rows if rows <= EXACT_ROWS else -(-rows // ROW_BUCKET) * ROW_BUCKET


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` over a 2-D ``x``, its rows bucketed where oneDNN would compile a kernel
    per row count (CPU, bf16 / fp16)."""
    rows = x.shape[0]
    padded = bucket_rows(rows)
    if padded == rows or x.dim() != 2 or x.device.type != "cpu" or x.dtype not in JIT_DTYPES:
        return F.linear(x, weight, bias)
    return F.linear(F.pad(x, (0, 0, 0, padded - rows)), weight, bias)[:rows]


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`linear` (same parameters and state-dict names)."""

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)
