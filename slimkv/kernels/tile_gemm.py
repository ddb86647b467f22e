"""``tile_gemm.c`` through ctypes: many-row matmuls over :func:`~slimkv.kernels.qgemm.pack`'ed
weights with AMX bf16 tiles, the weights dequantized on the fly (no bf16 copy of W).

:func:`tile_gemm_kernel` is None where the source cannot be built or the CPU (or the OS)
does not run AMX; callers then dequantize and take torch's GEMM, which computes the same
sums (float32 sums of the same bf16 products, in another order).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from slimkv.kernels import build

SOURCE = Path(__file__).with_name("tile_gemm.c")


class TileGemm:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, ptr = ctypes.c_int, ctypes.c_void_p
        self._fn = build.signature(lib.tile_gemm, [ptr, i32, i32, ptr, i32, i32, ptr, ptr])
        self.ready = bool(lib.tile_gemm_ready())

    def __call__(self, a: Tensor, packed: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        """``a [M, K]`` bfloat16 . ``W^T`` (``packed``: a ``[n, K]`` weight in qgemm's
        layout) -> ``[M, n]`` bfloat16; or, with ``out [M, n]`` float32, the result rounded
        to bfloat16 added into ``out``, which is returned."""
        if not a.is_contiguous():
            a = a.contiguous()
        rows, k = a.shape
        y = torch.empty(rows, n, dtype=torch.bfloat16) if out is None else None
        bits = (packed.shape[2] >> 6) - 1
        self._fn(a.data_ptr(), rows, k, packed.data_ptr(), bits, n,
                 None if y is None else y.data_ptr(), None if out is None else out.data_ptr())
        return out if y is None else y


def _wrap(lib: ctypes.CDLL) -> TileGemm | None:
    kernel = TileGemm(lib)
    return kernel if kernel.ready else None


_KERNEL = build.Kernel(SOURCE, _wrap)


def tile_gemm_kernel() -> TileGemm | None:
    """The AMX kernel, or None where the CPU or the build cannot run it."""
    return _KERNEL.get()
