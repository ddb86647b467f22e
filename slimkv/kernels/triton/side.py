"""The Triton kernels' view of one layer of one pool side (K or V).

The format numbers (element kind, scale mode, scale groups) come from
:func:`slimkv.kernels.kernel_format`, the mapping the C decode kernel uses, so both kernels
read a codec the same way: kinds float32, bfloat16, float16 (no scales), int8, fp8 e4m3,
fp8 e5m2 (one float16 scale per token-head, or per (block, head, channel) for keys with
per-channel-block scales), uint4 (asymmetric, scale and zero per group of 32 channels of a
token-head, or per (block, head, channel)).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slimkv.kernels import _KIND, _SCALE_BLOCK, _SCALE_NONE, _SCALE_TOKEN, _U4, kernel_format
from slimkv.kv.quant import KVCodec, QuantizedKV

F32, BF16, F16 = _KIND[torch.float32], _KIND[torch.bfloat16], _KIND[torch.float16]
I8, E4M3, E5M2, U4 = _KIND[torch.int8], _KIND[torch.float8_e4m3fn], _KIND[torch.float8_e5m2], _U4
NONE, TOKEN, BLOCK = _SCALE_NONE, _SCALE_TOKEN, _SCALE_BLOCK
QMAX = {I8: 127.0, E4M3: torch.finfo(torch.float8_e4m3fn).max,
        E5M2: torch.finfo(torch.float8_e5m2).max}


@dataclass(frozen=True)
class TritonSide:
    """One layer of a pool side: ``data [num_blocks, block_size, H, width]``; ``scale``/``zero``
    per token ``[num_blocks, block_size, H, groups]`` or per block ``[num_blocks, H, D]``
    (float16; None where the format has none); the format numbers of :func:`kernel_format`."""

    data: Tensor
    scale: Tensor | None
    zero: Tensor | None
    kind: int
    scale_mode: int
    groups: int

    @property
    def block_size(self) -> int:
        return self.data.shape[1]

    @property
    def num_kv_heads(self) -> int:
        return self.data.shape[2]

    def pointers(self) -> tuple[Tensor, Tensor, Tensor]:
        """data, scale, zero for a kernel launch (the data tensor stands in for a missing
        aux tensor; the kernels never read it as one)."""
        return (self.data, self.data if self.scale is None else self.scale,
                self.data if self.zero is None else self.zero)

    def formats(self) -> tuple[int, int, int]:
        return self.kind, self.scale_mode, self.groups


def describe(codec: KVCodec, layer_pool: QuantizedKV) -> TritonSide:
    """The kernels' view of one layer of a pool side (``cache.layer_pool(side, layer)``)."""
    fmt = kernel_format(codec)
    if fmt is None:
        raise ValueError(f"the Triton kernels lack the KV format of {codec!r}")
    tensors = (layer_pool.data, *(layer_pool.aux.get(n) for n in ("scale", "zero")))
    if any(t is not None and not t.is_contiguous() for t in tensors):
        raise ValueError("the Triton kernels need contiguous pool tensors")
    return TritonSide(*tensors, *fmt)
