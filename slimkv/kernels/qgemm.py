"""``qgemm.c`` through ctypes: weight-only int4/int8 matmuls with int8 activations.

See the C file for the format (groups of 32 along K, ``w = d * q + m``) and the fused
input modes. :func:`qgemm_kernel` returns None where the kernel cannot be built
(:func:`qgemm_unavailable_reason` says why); :func:`qgemm_native` says whether it runs a
vector path (AVX512-VNNI, or AVX2 with vpmaddubsw; elsewhere a portable loop computes the
same values, slowly).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from slimkv.kernels import build

SOURCE = Path(__file__).with_name("qgemm.c")
PLAIN, RMSNORM, SILU_MUL = 0, 1, 2  # what the kernel does to x on the way in
PRECISE = 4  # OR'ed into a mode: the int8 rounding residual is a second int8 row (~15 bits)


TILE = 16  # output rows per tile of the repacked layout
ROW_DTYPES = (torch.float32, torch.bfloat16)  # what QGemm.prep and QGemm.rope read and write


def pack(q: Tensor, d: Tensor, m: Tensor, bits: int) -> Tensor:
    """The kernel's layout of ``W [N, K]`` (codes ``q [N, K * bits / 8]`` uint8 in groups of
    32, ggml's nibble order; ``d, m [N, K / 32]`` float16): uint8 ``[tiles, K / 32, bytes]``,
    each tile's group the codes of 16 rows interleaved 4 bytes at a time, then d[16], m[16]
    (see qgemm.c). N is padded with zero rows to a multiple of 16. A permutation of the
    bytes: :func:`unpack_rows` inverts it."""
    n, groups = d.shape
    pad, tiles = -n % TILE, -(-n // TILE)
    q, d, m = (F.pad(t, (0, 0, 0, pad)) for t in (q, d, m))
    codes = q.view(tiles, TILE, groups, bits, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1)
    scales = torch.stack((d, m)).view(2, tiles, TILE, groups).permute(1, 3, 0, 2).reshape(
        tiles, groups, 2 * TILE)
    return torch.cat((codes, scales.contiguous().view(torch.uint8)), -1).contiguous()


def packed_bits(packed: Tensor) -> int:
    return (packed.shape[-1] - 4 * TILE) // (4 * TILE)


def unpack_rows(packed: Tensor, rows: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q, d, m`` of the selected rows (int64 indices) in the original layout."""
    rows = rows.reshape(-1)
    tiles, groups, width = packed.shape
    bits, sel = packed_bits(packed), packed[rows // TILE]
    lane, at = rows % TILE, torch.arange(len(rows))
    q = sel[..., :width - 4 * TILE].reshape(len(rows), groups, bits, TILE, 4)[at, :, :, lane]
    dm = sel[..., width - 4 * TILE:].contiguous().view(torch.float16)
    dm = dm.view(len(rows), groups, 2, TILE)[at, :, :, lane]
    return q.reshape(len(rows), -1), dm[..., 0], dm[..., 1]


class QGemm:
    """``y (+)= f(x) . W^T`` for a group-32 quantized ``W`` in :func:`pack`'s layout; see
    :meth:`__call__`."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, ptr, f32, sig = ctypes.c_int, ctypes.c_void_p, ctypes.c_float, build.signature
        self._fn = sig(lib.qgemm, [ptr, i32, i32, i32, i32, ptr, f32, ptr, i32, i32, ptr, i32])
        self.native = bool(lib.qgemm_native())
        self._dequant = sig(lib.qdequant, [ptr, i32, i32, i32, ptr, i32])
        self._rope = {dtype: sig(fn, [ptr, i32, i32, i32, i32, ptr, ptr]) for dtype, fn in
                      ((torch.float32, lib.rope_inplace), (torch.bfloat16, lib.rope_bf16))}
        self._add = sig(lib.add_bf16, [ptr, ptr, ctypes.c_size_t])
        self._prep = sig(lib.prep_rows, [ptr, i32, i32, i32, i32, i32, ptr, f32, ptr, i32])
        # (rows) -> the previous value: from how many rows the AMX int8 tiles take over
        self.amx_rows = sig(lib.qgemm_amx_rows, [i32], ctypes.c_int)

    def __call__(self, x: Tensor, packed: Tensor, n: int, *, mode: int = PLAIN,
                 norm_weight: Tensor | None = None, eps: float = 0.0,
                 out: Tensor | None = None) -> Tensor:
        """``x [M, K]`` float32 (``[M, 2K]`` = [gate | up] for SILU_MUL; normalised with
        ``norm_weight`` float32 for RMSNORM); ``packed``: :func:`pack` of a ``[n, K]``
        weight. Returns ``[M, n]`` float32, or adds into ``out`` and returns it."""
        if not x.is_contiguous():
            x = x.contiguous()
        rows, width = x.shape
        y = torch.empty(rows, n, dtype=torch.float32) if out is None else out
        self._fn(x.data_ptr(), rows, width // 2 if mode & 3 == SILU_MUL else width, width, mode,
                 None if norm_weight is None else norm_weight.data_ptr(), eps,
                 packed.data_ptr(), (packed.shape[2] >> 6) - 1, n, y.data_ptr(), out is not None)
        return y

    def dequantize(self, packed: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        """``W [n, K]`` of a :func:`pack`'ed weight in float32 or bfloat16 (other dtypes via
        float32)."""
        k = packed.shape[1] * 32
        bf16 = dtype == torch.bfloat16
        w = torch.empty(n, k, dtype=torch.bfloat16 if bf16 else torch.float32)
        self._dequant(packed.data_ptr(), packed_bits(packed), n, k, w.data_ptr(), int(bf16))
        return w.to(dtype)

    def prep(self, x: Tensor, mode: int, norm_weight: Tensor | None, eps: float,
             dtype: torch.dtype) -> Tensor:
        """What :meth:`__call__`'s input ``mode`` does to ``x [M, K]`` (``[M, 2K]`` for
        SILU_MUL; float32 or bfloat16), in float32, rounded once to ``dtype``: the float
        GEMM path's input, in one pass."""
        if x.dtype not in ROW_DTYPES or not x.is_contiguous():
            x = x.float().contiguous()
        rows, width = x.shape
        k = width // 2 if mode == SILU_MUL else width
        bf16 = dtype == torch.bfloat16
        y = torch.empty(rows, k, dtype=torch.bfloat16 if bf16 else torch.float32)
        self._prep(x.data_ptr(), int(x.dtype == torch.bfloat16), rows, k, width, mode,
                   None if norm_weight is None else norm_weight.data_ptr(), eps, y.data_ptr(),
                   int(bf16))
        return y.to(dtype)

    def add_into(self, out: Tensor, y: Tensor) -> Tensor:
        """``out += y`` (float32 ``out``; the exact values of ``y`` in any dtype), returned."""
        if out.dtype == torch.float32 and y.dtype == torch.bfloat16 and out.is_contiguous() \
                and y.is_contiguous() and out.shape == y.shape:
            self._add(out.data_ptr(), y.data_ptr(), out.numel())
            return out
        return out.add_(y)

    def rope(self, x: Tensor, heads: int, head_dim: int, cos: Tensor, sin: Tensor) -> None:
        """RoPE in place on the first ``heads`` heads of each row of ``x [T, width]``
        (float32, or bfloat16: rotated in float32, rounded to nearest even; contiguous);
        ``cos``, ``sin``: float32 ``[T, head_dim]``."""
        cos, sin = cos.contiguous(), sin.contiguous()
        self._rope[x.dtype](x.data_ptr(), x.shape[0], x.shape[1], heads, head_dim,
                            cos.data_ptr(), sin.data_ptr())


_KERNEL = build.Kernel(SOURCE, QGemm)
qgemm_kernel = _KERNEL.get
qgemm_unavailable_reason = _KERNEL.reason


def qgemm_native() -> bool:
    kernel = qgemm_kernel()
    return kernel is not None and kernel.native
