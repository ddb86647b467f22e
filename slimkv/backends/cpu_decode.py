"""The fused paged decode kernel's glue (``slimkv/kernels/paged_decode.c``: single-token
queries attend over quantized KV blocks without a float copy of the cache; see its header).
The shared library is built once per source/compiler/CPU by :mod:`slimkv.kernels.build`.
Where no compiler is found, :func:`decode_kernel` returns None and says why
(:func:`kernel_unavailable_reason`): the engine then decodes on the gather-then-SDPA path
and reports it, never silently.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from slimkv.kernels import _KIND, build, kernel_format
from slimkv.kv.quant import KVCodec, QuantizedKV

SOURCE = Path(build.__file__).with_name("paged_decode.c")


class KVSide(ctypes.Structure):
    """Mirror of ``kv_side`` in paged_decode.c: one side (K or V) of one layer."""

    _fields_ = [("data", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("zero", ctypes.c_void_p),
                ("kind", ctypes.c_int32), ("scale_mode", ctypes.c_int32),
                ("groups", ctypes.c_int32), ("width", ctypes.c_int32),
                ("sink_from", ctypes.c_int64), ("sink_shift", ctypes.c_int64)]


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def describe(codec: KVCodec, layer_pool: QuantizedKV) -> KVSide:
    """The kernel's view of one layer of a pool side (a format :func:`kernel_format` knows).

    ``layer_pool`` holds that layer's tensors; the view keeps them alive."""
    kind, mode, groups = kernel_format(codec)
    side = KVSide(_ptr(layer_pool.data), _ptr(layer_pool.aux.get("scale")),
                  _ptr(layer_pool.aux.get("zero")), kind, mode, groups, codec.data_width, 2**63 - 1, 0)
    side.keep = layer_pool
    return side


class DecodeKernel:
    """``paged_decode`` with argument types; see :meth:`__call__`."""

    def __init__(self, lib: ctypes.CDLL, name: str = "paged_decode") -> None:
        """``name``: ``paged_decode`` (the tiled AVX-512 or AVX2 path where built for one,
        else the portable loop) or ``paged_decode_portable`` (the portable loop always:
        tests)."""
        i32, ptr, side = ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(KVSide)
        self._fn = build.signature(getattr(lib, name), [ptr, ptr, i32, i32, i32, i32, i32, ptr,
                                                        i32, ptr, side, side, ptr, ptr, i32,
                                                        ptr, ctypes.c_float])

    def __call__(self, q: Tensor, block_tables: Tensor, seq_lens: Tensor, k: KVSide, v: KVSide,
                 num_kv_heads: int, block_size: int, scale: float,
                 staged: tuple[Tensor, Tensor, Tensor] | None) -> Tensor:
        """``q [B, Hq, D]`` float32 over the blocks of ``block_tables [B, m]`` (int64) up to
        ``seq_lens [B]``; ``staged``: (staged K, staged V ``[slots, block_size, H, D]``, slot
        per sequence ``[B]``) for a staged cache (:mod:`slimkv.kv.staging`), whose last
        block is read from there."""
        batch, num_heads, head_dim = q.shape
        out = torch.empty_like(q)
        staged_k, staged_v, slots = staged if staged is not None else (None, None, None)
        staged_kind = _KIND[staged_k.dtype] if staged_k is not None else 0
        self._fn(q.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads, head_dim, block_size,
                 block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
                 ctypes.byref(k), ctypes.byref(v), _ptr(staged_k), _ptr(staged_v), staged_kind,
                 _ptr(slots), scale)
        return out


_KERNEL = build.Kernel(SOURCE, DecodeKernel)
decode_kernel = _KERNEL.get
kernel_unavailable_reason = _KERNEL.reason
