"""Weights into the 4/8-bit class at load time (:class:`~slimkv.model.quant.QuantTensor`,
groups of 32 along K with ``w = d * q + m``): a GGUF's Q4_0/Q4_1/Q8_0 blocks adopted as they
are, float weights quantized min/max per group, 4-bit codes widened to 8 bits exactly."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from slimkv.model.quant import GROUP, QuantTensor

GGUF_CLASSES = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}  # GGUF tensor types adopted as they are


def quantize(w: Tensor, bits: int) -> QuantTensor:
    """Min/max per group of 32 (K must be a multiple of 32)."""
    rows, k = w.shape
    if k % GROUP:
        raise ValueError(f"cannot quantize a [{rows}, {k}] weight: K is not a multiple of 32")
    g = w.float().view(rows, k // GROUP, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    top = (1 << bits) - 1
    d = ((hi - lo) / top).half()
    m = lo.half()
    inv = torch.where(d.float() > 0, 1 / d.float(), torch.zeros_like(lo))
    q = ((g - m.float()[..., None]) * inv[..., None]).round().clamp(0, top).to(torch.uint8)
    if bits == 4:
        q = q[..., :GROUP // 2] | (q[..., GROUP // 2:] << 4)
    return QuantTensor(q.reshape(rows, -1).contiguous(), d, m, bits)


def to_bits(w: QuantTensor, bits: int) -> QuantTensor:
    """``w`` in the ``bits`` class: 4 -> 8 keeps ``d`` and ``m`` (exact), 8 -> 4 requantizes."""
    if bits == w.bits:
        return w
    if bits == 8:
        return QuantTensor(w.codes().contiguous(), w.d, w.m, 8)
    return quantize(w.dequantize(), bits)


def from_gguf(raw: np.ndarray, type_name: str) -> QuantTensor:
    """A GGUF tensor's blocks (``raw`` uint8 ``[N, bytes per row]``) as they are."""
    rows = raw.shape[0]
    size = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}[type_name]
    blocks = np.ascontiguousarray(raw).reshape(rows, -1, size)
    d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)[..., 0])
    if type_name == "Q4_1":
        m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)[..., 0])
        q = blocks[..., 4:]
    else:
        m = d * (-8 if type_name == "Q4_0" else -128)  # exact in float16: a power of two
        q = blocks[..., 2:] ^ np.uint8(0x80) if type_name == "Q8_0" else blocks[..., 2:]
    q = torch.from_numpy(np.ascontiguousarray(q).reshape(rows, -1))
    return QuantTensor(q, d, m, GGUF_CLASSES[type_name])


def cat_rows(parts: list[QuantTensor]) -> QuantTensor:
    """Stack along N (a fused projection); mixed classes meet at 8 bits (4 -> 8 is exact)."""
    bits = max(p.bits for p in parts)
    parts = [to_bits(p, bits) for p in parts]
    return QuantTensor(*(torch.cat([getattr(p, f) for p in parts]) for f in "qdm"), bits)
