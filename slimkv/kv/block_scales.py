"""Per-channel key scales per block: one scale (and zero point) per head-dim channel,
computed over the ``block_size`` tokens of a full block.

Keys carry outlier channels (a few head dims are large for every token, more so after
RoPE): a per-token scale is set by the outliers and wastes the levels of every other
channel, while a per-channel scale fits each channel's own range. A block's scales can
only be computed once all of its tokens are known, so the cache keeps a sequence's last,
partial block in a full-precision staging buffer (:mod:`slimkv.kv.staging`) and hands it
to these codecs when it fills.

``quantize`` takes whole blocks ``x[..., block_size, H, D]``; the scales are
``[..., H, D]`` (reduced over the token axis ``-3``) and stored per block.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimkv.kv.quant import (Fp8Codec, Int4Codec, Int8Codec, KVCodec,
                             PerTokenHeadCodec, QuantizedKV, _stored_scale)

_TOKENS = -3


class ChannelBlockCodec(KVCodec):
    """Symmetric 8-bit (int8, fp8) with a float16 scale per (block, head, channel)."""

    def __init__(self, element: PerTokenHeadCodec) -> None:
        super().__init__(element.name, element.head_dim)
        self.element = element
        self.storage_dtype = element.storage_dtype

    @property
    def block_aux_widths(self) -> dict[str, int]:
        return {"scale": self.head_dim}

    def quantize(self, x: Tensor) -> QuantizedKV:
        x = x.float()
        scale = _stored_scale(x.abs().amax(_TOKENS) / self.element.qmax)
        return QuantizedKV(self.element._encode(x / scale.float().unsqueeze(_TOKENS)),
                           {"scale": scale})

    def dequantize(self, q: QuantizedKV, dtype: torch.dtype) -> Tensor:
        scale = q.aux["scale"].float().unsqueeze(_TOKENS)
        return (self.element._decode(q.data) * scale).to(dtype)


class ChannelBlockInt4Codec(KVCodec):
    """Asymmetric 4-bit with a float16 scale and zero per (block, head, channel); values
    packed two per byte along the head dim exactly as :class:`Int4Codec`."""

    storage_dtype = torch.uint8

    def __init__(self, element: Int4Codec) -> None:
        super().__init__(element.name, element.head_dim)
        self.element = element

    @property
    def data_width(self) -> int:
        return self.head_dim // 2

    @property
    def block_aux_widths(self) -> dict[str, int]:
        return {"scale": self.head_dim, "zero": self.head_dim}

    def quantize(self, x: Tensor) -> QuantizedKV:
        q, aux = self.element.encode(x.float(), _TOKENS)
        return QuantizedKV(self.element.pack(q), aux)

    def dequantize(self, q: QuantizedKV, dtype: torch.dtype) -> Tensor:
        return self.element.decode(self.element.unpack(q.data), q.aux, _TOKENS).to(dtype)


def per_channel_block(element: KVCodec) -> KVCodec:
    """The per-channel-per-block layout of a per-token ``element`` codec (int8, fp8, int4),
    sharing its element encoding."""
    if isinstance(element, (Int8Codec, Fp8Codec)):
        return ChannelBlockCodec(element)
    if isinstance(element, Int4Codec):
        return ChannelBlockInt4Codec(element)
    raise ValueError(f"per_channel_block key scales need a quantized KV dtype, "
                     f"got {element.name!r}")

