"""``kv_stage.c`` through ctypes: a decode step's K/V into the staging slots, Q rounded to
the model dtype, in one call per layer. :func:`stage_kernel` is None where it cannot be
built (the attention then takes its torch path). Only the CPU backend and its one-call step
call it, so its glue lives with them (the C source stays with the other kernels)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from slimkv import kernels
from slimkv.kernels import build

SOURCE = Path(kernels.__file__).with_name("kv_stage.c")
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class StageKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        self._fn = build.signature(lib.stage_decode, [ptr, i64, ptr, i64, ptr, i64, i32, i32,
                                                       i32, i32, i32, ptr, ptr, ptr, i32, i32,
                                                       ptr, ptr])

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, q_dtype: torch.dtype,
                 stage_k: Tensor, stage_v: Tensor, slots: Tensor, offsets: Tensor,
                 q_out: Tensor | None = None) -> Tensor:
        """``q [T, Hq, D]``, ``k, v [T, H, D]`` float32 (heads contiguous in a row): K, V
        into ``stage_k, stage_v [slots, block_size, H, D]`` at ``slots``, ``offsets [T]``
        (int64); returns Q rounded to ``q_dtype``, as float32 ``[T, Hq, D]`` (in ``q_out``
        when given)."""
        T, num_heads, head_dim = q.shape
        q_out = torch.empty(q.shape, dtype=torch.float32) if q_out is None else q_out
        self._fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                 v.stride(0), T, num_heads, k.shape[1], head_dim, KINDS[q_dtype],
                 q_out.data_ptr(), stage_k.data_ptr(), stage_v.data_ptr(), KINDS[stage_k.dtype],
                 stage_k.shape[1], slots.data_ptr(), offsets.data_ptr())
        return q_out

    @staticmethod
    def takes(x: Tensor) -> bool:
        """Whether ``x [T, H, D]`` is laid out as the kernel reads it."""
        return x.dtype == torch.float32 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


_KERNEL = build.Kernel(SOURCE, StageKernel)
stage_kernel = _KERNEL.get
