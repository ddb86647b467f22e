"""``qgemm.c`` through ctypes: weight-only int4/int8 matmuls with int8 activations.

See the C file for the format (groups of 32 along K, ``w = d * q + m``) and the fused
input modes. :func:`qgemm_kernel` returns None where the kernel cannot be built
(:func:`qgemm_unavailable_reason` says why); :func:`qgemm_native` says whether it runs the
AVX512-VNNI path (elsewhere a portable loop computes the same values, slowly).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from slimkv.kernels import build

SOURCE = Path(__file__).with_name("qgemm.c")
PLAIN, RMSNORM, SILU_MUL = 0, 1, 2  # what the kernel does to x on the way in
PRECISE = 4  # OR'ed into a mode: the int8 rounding residual is a second int8 row (~15 bits)


class QGemm:
    """``y (+)= f(x) . W^T`` for a group-32 quantized ``W``; see :meth:`__call__`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.qgemm
        i32, ptr = ctypes.c_int, ctypes.c_void_p
        self._fn.argtypes = [ptr, i32, i32, i32, i32, ptr, ctypes.c_float, ptr, ptr, ptr, i32,
                             i32, ptr, i32]
        self._fn.restype = None
        self.native = bool(lib.qgemm_native())
        self._dequant = lib.qdequant
        self._dequant.argtypes = [ptr, ptr, ptr, i32, i32, i32, ptr, i32]
        self._dequant.restype = None
        self._rope = lib.rope_inplace
        self._rope.argtypes = [ptr, i32, i32, i32, i32, ptr, ptr]
        self._rope.restype = None

    def __call__(self, x: Tensor, q: Tensor, d: Tensor, m: Tensor, bits: int, *,
                 mode: int = PLAIN, norm_weight: Tensor | None = None, eps: float = 0.0,
                 out: Tensor | None = None) -> Tensor:
        """``x [M, K]`` float32 (``[M, 2K]`` = [gate | up] for SILU_MUL; normalised with
        ``norm_weight`` float32 for RMSNORM); ``q [N, K * bits / 8]`` uint8, ``d, m [N, K / 32]``
        float16. Returns ``[M, N]`` float32, or adds into ``out`` and returns it."""
        x = x.contiguous()
        rows, width = x.shape
        k = width // 2 if mode & 3 == SILU_MUL else width
        n = q.shape[0]
        y = torch.empty(rows, n, dtype=torch.float32) if out is None else out
        norm = norm_weight.data_ptr() if norm_weight is not None else None
        self._fn(x.data_ptr(), rows, k, width, mode, norm, eps, q.data_ptr(), d.data_ptr(),
                 m.data_ptr(), bits, n, y.data_ptr(), int(out is not None))
        return y


    def dequantize(self, q: Tensor, d: Tensor, m: Tensor, bits: int,
                   dtype: torch.dtype) -> Tensor:
        """``W [N, K]`` in float32 or bfloat16 (other dtypes via float32)."""
        n, k = q.shape[0], d.shape[1] * 32
        bf16 = dtype == torch.bfloat16
        w = torch.empty(n, k, dtype=torch.bfloat16 if bf16 else torch.float32)
        self._dequant(q.data_ptr(), d.data_ptr(), m.data_ptr(), bits, n, k, w.data_ptr(),
                      int(bf16))
        return w.to(dtype)


    def rope(self, x: Tensor, heads: int, head_dim: int, cos: Tensor, sin: Tensor) -> None:
        """RoPE in place on the first ``heads`` heads of each row of ``x [T, width]``
        (float32, contiguous); ``cos``, ``sin``: float32 ``[T, head_dim]``."""
        cos, sin = cos.contiguous(), sin.contiguous()
        self._rope(x.data_ptr(), x.shape[0], x.shape[1], heads, head_dim, cos.data_ptr(),
                   sin.data_ptr())


_KERNEL = build.Kernel(SOURCE, QGemm)
qgemm_kernel = _KERNEL.get
qgemm_unavailable_reason = _KERNEL.reason


def qgemm_native() -> bool:
    kernel = qgemm_kernel()
    return kernel is not None and kernel.native
