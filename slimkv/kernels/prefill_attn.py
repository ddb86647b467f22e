"""``prefill_attention.c`` through ctypes: a bf16 chunk's attention (grouped heads, causal or
under an additive mask) with AVX-512 BF16. :func:`prefill_kernel` is None where it cannot be
had (no compiler, or a CPU without AVX512-BF16: :func:`prefill_kernel_unavailable_reason`
says which); prefill then stays on torch's SDPA."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch
from torch import Tensor

from slimkv.kernels import build

SOURCE = Path(__file__).with_name("prefill_attention.c")


class PrefillKernel:
    def __init__(self, lib: ctypes.CDLL) -> None:
        i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
        self._fn = build.signature(lib.prefill_attention, [ptr, i64, ptr, i64, ptr, i64, ptr,
                                                            i64, ptr, i64, i32, i32, i32, i32,
                                                            i32, ctypes.c_float])
        self.lib = lib  # its other entry, prefill_attention_staged: slimkv.backends.cpu_prefill

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None,
                 scale: float) -> Tensor:
        """``q [n, Hq, D]`` over ``k, v [L, H, D]`` (bf16, see :meth:`takes`) under the
        additive ``mask [n, L]``, or causally (query ``i`` sees keys up to ``i + L - n``)
        when ``mask`` is None -> ``[n, Hq, D]`` bf16."""
        n, num_heads, head_dim = q.shape
        out = torch.empty(q.shape, dtype=q.dtype)
        self._fn(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
                 v.stride(0), 0 if mask is None else mask.data_ptr(),
                 0 if mask is None else mask.stride(0), out.data_ptr(), out.stride(0), n,
                 k.shape[0], num_heads, k.shape[1], head_dim, scale)
        return out

    @staticmethod
    def takes(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> bool:
        """Whether the kernel reads these as they are: real (not fake: memory profiling)
        bf16 tensors on the CPU, each token's heads contiguous, a head dim that is a
        multiple of 32 up to 256, the mask's rows contiguous."""
        head_dim = q.shape[-1]
        rows = all(type(x) is torch.Tensor and x.dtype == torch.bfloat16
                   and x.device.type == "cpu" and x.stride(2) == 1 and x.stride(1) == head_dim
                   for x in (q, k, v))
        masked = mask is None or (type(mask) is torch.Tensor and mask.dtype == torch.bfloat16
                                  and mask.stride(1) == 1)
        return rows and masked and head_dim % 32 == 0 and head_dim <= 256


def _wrap(lib: ctypes.CDLL) -> PrefillKernel | str:
    if not lib.prefill_attention_native():
        return "this CPU has no AVX512-BF16: prefill attention stays on torch's SDPA"
    return PrefillKernel(lib)


_KERNEL = build.Kernel(SOURCE, _wrap)
prefill_kernel = _KERNEL.get
prefill_kernel_unavailable_reason = _KERNEL.reason
