"""Native CPU kernels, compiled on first use with the system C compiler and called via ctypes
(:mod:`slimkv.kernels.build`: ``-march=native``, OpenMP shared with torch), and the KV format
numbers every kernel reads (:func:`kernel_format`). The decode kernel's glue lives with the
CPU backend (:mod:`slimkv.backends.cpu_decode`), the Triton kernels in :mod:`.triton`.
"""

from __future__ import annotations

import torch

from slimkv.kv.block_scales import ChannelBlockCodec, ChannelBlockInt4Codec
from slimkv.kv.quant import Fp8Codec, FloatCodec, Int4Codec, Int8Codec, KVCodec

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int8: 3,
         torch.float8_e4m3fn: 4, torch.float8_e5m2: 5}
_U4 = 6
_SCALE_NONE, _SCALE_TOKEN, _SCALE_BLOCK = 0, 1, 2


def kernel_format(codec: KVCodec) -> tuple[int, int, int] | None:
    """(kind, scale mode, scale groups) of a codec, or None for a format the kernel lacks."""
    element = getattr(codec, "element", codec)
    block = isinstance(codec, (ChannelBlockCodec, ChannelBlockInt4Codec))
    mode = _SCALE_BLOCK if block else _SCALE_TOKEN
    if isinstance(codec, FloatCodec):
        return _KIND[codec.storage_dtype], _SCALE_NONE, 1
    if isinstance(element, Int8Codec):
        return _KIND[torch.int8], mode, 1
    if isinstance(element, Fp8Codec):
        return _KIND[element.fp8_dtype], mode, 1
    if isinstance(element, Int4Codec):
        return _U4, mode, element.num_groups
    return None
