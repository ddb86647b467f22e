"""KV element formats ("codecs"): how one token-head vector of K or V is stored.

A codec turns a block ``x[..., block_size, num_heads, head_dim]`` into a
:class:`QuantizedKV`: a data tensor ``[..., block_size, num_heads, data_width]`` of
``storage_dtype`` plus named auxiliary float16 tensors (scales, zero points). Per-token aux
(``aux_widths``) is ``[..., block_size, num_heads, width]``; per-block aux
(``block_aux_widths``, e.g. per-channel key scales over a block's tokens, see
:mod:`slimkv.kv.block_scales`) is ``[..., num_heads, width]``. The pool allocates whatever
the codec lists, so a new scale scheme is a new codec; the cache code stays unchanged.
Per-token codecs accept any leading shape ``[..., head_dim]``.

Scales are computed in float32, rounded to the stored float16 and then *used in that
rounded form* to quantize, so dequantization reproduces exactly what quantization assumed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
from torch import Tensor

from slimkv.config import INT4_GROUP

AUX_DTYPE = torch.float16
# Smallest normal float16: scales never go to zero or denormal.
_MIN_SCALE = torch.finfo(AUX_DTYPE).tiny
_FLOAT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_FP8_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
_ALIASES = {"fp8": "fp8_e4m3"}


@dataclass(slots=True)
class QuantizedKV:
    """Encoded token-head vectors: ``data[..., data_width]`` and ``aux[name][..., width]``."""

    data: Tensor
    aux: dict[str, Tensor] = field(default_factory=dict)


def _stored_scale(scale: Tensor) -> Tensor:
    """Round a float32 scale to the float16 that will be stored, clamped away from 0."""
    return scale.clamp(min=_MIN_SCALE).to(AUX_DTYPE)


class KVCodec(ABC):
    """One KV element format for vectors of ``head_dim`` elements."""

    storage_dtype: torch.dtype

    def __init__(self, name: str, head_dim: int) -> None:
        self.name = name
        self.head_dim = head_dim

    @property
    def data_width(self) -> int:
        """Elements of ``storage_dtype`` stored per token-head."""
        return self.head_dim

    @property
    def aux_widths(self) -> dict[str, int]:
        """Float16 values stored per token-head for each per-token auxiliary tensor."""
        return {}

    @property
    def block_aux_widths(self) -> dict[str, int]:
        """Float16 values stored per block-head for each per-block auxiliary tensor."""
        return {}

    def bytes_per_token_head(self) -> int:
        """Bytes of data and per-token aux of one token-head (per-block aux excluded)."""
        data = self.data_width * self.storage_dtype.itemsize
        return data + sum(self.aux_widths.values()) * AUX_DTYPE.itemsize

    def bytes_per_block_head(self, block_size: int) -> int:
        """Exact bytes of one head of one block: data, per-token and per-block aux."""
        block_aux = sum(self.block_aux_widths.values()) * AUX_DTYPE.itemsize
        return block_size * self.bytes_per_token_head() + block_aux

    @abstractmethod
    def quantize(self, x: Tensor) -> QuantizedKV:
        """Encode ``x[..., head_dim]``."""

    @abstractmethod
    def dequantize(self, q: QuantizedKV, dtype: torch.dtype) -> Tensor:
        """Decode to ``[..., head_dim]`` in ``dtype``."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, head_dim={self.head_dim})"


class FloatCodec(KVCodec):
    """Plain floating point: stored as is, no scales."""

    def __init__(self, name: str, head_dim: int) -> None:
        super().__init__(name, head_dim)
        self.storage_dtype = _FLOAT_DTYPES[name]

    def quantize(self, x: Tensor) -> QuantizedKV:
        return QuantizedKV(x.to(self.storage_dtype))

    def dequantize(self, q: QuantizedKV, dtype: torch.dtype) -> Tensor:
        return q.data.to(dtype)


class PerTokenHeadCodec(KVCodec):
    """Symmetric 8-bit formats with one float16 scale per token-head (absmax / qmax)."""

    qmax: float

    @property
    def aux_widths(self) -> dict[str, int]:
        return {"scale": 1}

    def quantize(self, x: Tensor) -> QuantizedKV:
        x = x.float()
        scale = _stored_scale(x.abs().amax(-1, keepdim=True) / self.qmax)
        return QuantizedKV(self._encode(x / scale.float()), {"scale": scale})

    def dequantize(self, q: QuantizedKV, dtype: torch.dtype) -> Tensor:
        return (self._decode(q.data) * q.aux["scale"].float()).to(dtype)

    @abstractmethod
    def _encode(self, y: Tensor) -> Tensor:
        """Store ``y`` (already divided by the scale, within about ``±qmax``)."""

    @abstractmethod
    def _decode(self, data: Tensor) -> Tensor:
        """Stored values back to float32, before multiplying by the scale."""


class Int8Codec(PerTokenHeadCodec):
    storage_dtype = torch.int8
    qmax = 127.0

    def _encode(self, y: Tensor) -> Tensor:
        return y.round().clamp(-self.qmax, self.qmax).to(torch.int8)

    def _decode(self, data: Tensor) -> Tensor:
        return data.float()


class Fp8Codec(PerTokenHeadCodec):
    """FP8 values kept in a uint8 pool: float8 tensors lack index_copy and some indexing
    kernels on some devices, while uint8 works everywhere and ``.view`` is free."""

    storage_dtype = torch.uint8

    def __init__(self, name: str, head_dim: int) -> None:
        super().__init__(name, head_dim)
        self.fp8_dtype = _FP8_DTYPES[name]
        self.qmax = torch.finfo(self.fp8_dtype).max

    def _encode(self, y: Tensor) -> Tensor:
        return y.clamp(-self.qmax, self.qmax).to(self.fp8_dtype).view(torch.uint8)

    def _decode(self, data: Tensor) -> Tensor:
        return data.view(self.fp8_dtype).float()


class Int4Codec(KVCodec):
    """Asymmetric unsigned 4-bit in groups along head_dim, two values per byte.

    Element ``2i`` sits in the low nibble of byte ``i``, element ``2i + 1`` in the high one.
    Per group: ``x ~= q * scale + zero`` with ``zero`` the group minimum.
    """

    storage_dtype = torch.uint8
    QMAX = 15
    # float16 rounds with relative error <= 2**-11; widening by 2**-10 before rounding keeps
    # the stored zero <= min and the stored range >= max - zero, so clamping never bites.
    _MARGIN = 2.0**-10

    def __init__(self, name: str, head_dim: int, group_size: int = INT4_GROUP) -> None:
        super().__init__(name, head_dim)
        if head_dim % 2 or group_size <= 0 or head_dim % group_size:
            raise ValueError(f"int4 KV needs an even head_dim divisible by the group size, "
                             f"got head_dim={head_dim}, group_size={group_size}")
        self.group_size = group_size
        self.num_groups = head_dim // group_size

    @property
    def data_width(self) -> int:
        return self.head_dim // 2

    @property
    def aux_widths(self) -> dict[str, int]:
        return {"scale": self.num_groups, "zero": self.num_groups}

    def quantize(self, x: Tensor) -> QuantizedKV:
        groups = x.float().unflatten(-1, (self.num_groups, self.group_size))
        q, aux = self.encode(groups, -1)
        return QuantizedKV(self.pack(q.flatten(-2)), aux)

    @classmethod
    def encode(cls, x: Tensor, dim: int) -> tuple[Tensor, dict[str, Tensor]]:
        """Levels of float32 ``x`` (uint8, unpacked) and the stored float16 ``scale`` and
        ``zero`` of each slice along ``dim``, covering its range with ``QMAX + 1`` levels."""
        low, high = x.amin(dim), x.amax(dim)
        zero = (low - low.abs() * cls._MARGIN).to(AUX_DTYPE)
        scale = _stored_scale((high - zero.float()) / cls.QMAX * (1 + cls._MARGIN))
        q = (x - zero.float().unsqueeze(dim)) / scale.float().unsqueeze(dim)
        return q.round().clamp(0, cls.QMAX).to(torch.uint8), {"scale": scale, "zero": zero}

    @staticmethod
    def decode(levels: Tensor, aux: dict[str, Tensor], dim: int) -> Tensor:
        """Float32 values of ``levels`` with the ``scale``/``zero`` of each slice along ``dim``."""
        scale, zero = (aux[name].float().unsqueeze(dim) for name in ("scale", "zero"))
        return levels.float() * scale + zero

    @staticmethod
    def pack(q: Tensor) -> Tensor:
        """``uint8`` nibbles ``[..., 2n]`` -> bytes ``[..., n]`` (even index in the low nibble)."""
        return q[..., 0::2] | (q[..., 1::2] << 4)

    @staticmethod
    def unpack(data: Tensor) -> Tensor:
        """The inverse of :meth:`pack`."""
        return torch.stack((data & 0xF, data >> 4), dim=-1).flatten(-2)

    def dequantize(self, q: QuantizedKV, dtype: torch.dtype) -> Tensor:
        groups = self.unpack(q.data).unflatten(-1, (self.num_groups, self.group_size))
        return self.decode(groups, q.aux, -1).flatten(-2).to(dtype)


KV_CODEC_NAMES = (*_FLOAT_DTYPES, "int8", "fp8", *_FP8_DTYPES, "int4")


def make_codec(name: str, head_dim: int, group_size: int = INT4_GROUP) -> KVCodec:
    """The codec for a KV dtype config string (``auto`` must be resolved by the caller)."""
    canonical = _ALIASES.get(name, name)
    if canonical in _FLOAT_DTYPES:
        return FloatCodec(canonical, head_dim)
    if canonical == "int8":
        return Int8Codec(canonical, head_dim)
    if canonical in _FP8_DTYPES:
        return Fp8Codec(canonical, head_dim)
    if canonical == "int4":
        return Int4Codec(canonical, head_dim, group_size)
    raise ValueError(f"unknown KV cache dtype {name!r}; choose one of {', '.join(KV_CODEC_NAMES)}")
