"""Pool writes in Triton: quantize a step's K/V rows and scatter them into the paged pool.

:func:`write_tokens` (one launch per layer call, K and V together) stores token ``t`` at
``slot_mapping[t]`` with per-token scales, as :meth:`PagedKVCache.write` does;
:func:`store_blocks` (one launch) quantizes whole staged blocks into the pool, keys with
per-channel-block scales (:mod:`slimkv.kv.block_scales`) and values per token, as
:meth:`PagedKVCache.write_blocks` does when a staged block fills.

Codes and scales equal the codecs' (:mod:`slimkv.kv.quant`) bit for bit: absmax (or
min/max) in float32, scale rounded to the stored float16 (clamped to float16's smallest
normal) and the codes computed from that rounded scale, with correctly rounded divisions
(``tl.div_rn``) and round-half-to-even done exactly (:func:`_rne`, :func:`_to_fp8`: no
libdevice, no fp8 type, so any GPU and the interpreter compute the same).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from slimkv.kernels.triton import side as fmt
from slimkv.kernels.triton.interpret import fix_loop_bounds
from slimkv.kernels.triton.side import TritonSide

fix_loop_bounds()  # Triton 3.6's interpreter: loops over runtime bounds (interpret.py)

_BF16, _F16, _I8, _E4M3, _U4 = (tl.constexpr(k) for k in (fmt.BF16, fmt.F16, fmt.I8, fmt.E4M3,
                                                           fmt.U4))
_NONE, _TOKEN, _BLOCK = (tl.constexpr(m) for m in (fmt.NONE, fmt.TOKEN, fmt.BLOCK))
_TINY = tl.constexpr(2.0**-14)  # float16's smallest normal: scales never go below it
_MARGIN = tl.constexpr(2.0**-10)  # Int4Codec._MARGIN
assert max(fmt.F32, fmt.BF16, fmt.F16) == fmt.F16 < min(fmt.I8, fmt.E4M3, fmt.E5M2, fmt.U4)


@triton.jit
def _rne(y):
    """``y`` rounded half to even (``torch.round``), exact for ``|y| < 2**23``."""
    r = tl.floor(y)
    f = y - r
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return r + ((f > 0.5) | ((f == 0.5) & odd)).to(tl.float32)


@triton.jit
def _to_fp8(y, M: tl.constexpr, BIAS: tl.constexpr):
    """fp8 codes (int32) of float32 ``y`` within the finite range, rounded half to even as
    ``Tensor.to(float8)``: ``|y|`` in units of its fp8 quantum ``2**qe`` rounds to ``n``,
    and the code is ``(E - 1) << M`` plus ``n`` (a carry into the exponent comes free)."""
    bits = y.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, 1 - BIAS)  # exponent, subnormals' floor
    inverse = ((127 - (e - M)) << 23).to(tl.float32, bitcast=True)  # 2**-qe, exact
    n = _rne(tl.abs(y) * inverse).to(tl.int32)
    return ((bits >> 24) & 0x80) | (((e + BIAS - 1) << M) + n)


@triton.jit
def _to_bf16(x):
    """float32 to bfloat16 rounded half to even, in integer steps (Triton's interpreter
    truncates in ``.to(tl.bfloat16)``; GPUs round: this is the same on both)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _stored(scale):
    """A float32 scale as the float16 stored (``quant._stored_scale``)."""
    return tl.maximum(scale, _TINY).to(tl.float16)


@triton.jit
def _codes8(y, KIND: tl.constexpr):
    """8-bit codes of ``y`` (already divided by its scale), clamped as the codecs clamp."""
    if KIND == _I8:
        return tl.minimum(tl.maximum(_rne(y), -127.0), 127.0).to(tl.int8)
    elif KIND == _E4M3:
        return _to_fp8(tl.minimum(tl.maximum(y, -448.0), 448.0), 3, 7).to(tl.uint8)
    else:
        return _to_fp8(tl.minimum(tl.maximum(y, -57344.0), 57344.0), 2, 15).to(tl.uint8)


@triton.jit
def _encode_store(x, rows, rmask, data, scale, zero, scale_at, H, D: tl.constexpr,
                  R_PAD: tl.constexpr, D_PAD: tl.constexpr, KIND: tl.constexpr,
                  MODE: tl.constexpr, GROUPS: tl.constexpr):
    """Rows ``x [R, D]`` (float32) of one side stored at pool rows ``rows``: cast for float
    pages; with scales per row (TOKEN) or, for the R tokens of one block-head, per channel
    over the rows (BLOCK, stored at ``scale_at + d``)."""
    offs_d = tl.arange(0, D_PAD)
    dmask = offs_d[None, :] < D
    mask = rmask[:, None] & dmask
    if KIND == _BF16:
        tl.store(data + rows[:, None] * D + offs_d[None, :], _to_bf16(x), mask)
    elif KIND <= _F16:
        tl.store(data + rows[:, None] * D + offs_d[None, :], x.to(data.dtype.element_ty), mask)
    elif KIND == _U4:
        if MODE == _BLOCK:  # per channel over the block's tokens
            low = tl.min(tl.where(rmask[:, None], x, float("inf")), 0)[None, :]
            high = tl.max(tl.where(rmask[:, None], x, float("-inf")), 0)[None, :]
        else:  # per group of D // GROUPS channels (padded channels: whole groups of 0)
            groups = tl.reshape(x, (R_PAD, D_PAD // (D // GROUPS), D // GROUPS))
            low = tl.reshape(tl.broadcast_to(tl.min(groups, 2)[:, :, None], groups.shape),
                             (R_PAD, D_PAD))
            high = tl.reshape(tl.broadcast_to(tl.max(groups, 2)[:, :, None], groups.shape),
                              (R_PAD, D_PAD))
        zero_h = (low - tl.abs(low) * _MARGIN).to(tl.float16)
        scale_h = _stored(tl.div_rn(high - zero_h.to(tl.float32), 15.0) * (1 + _MARGIN))
        y = tl.div_rn(x - zero_h.to(tl.float32), scale_h.to(tl.float32))
        levels = tl.minimum(tl.maximum(_rne(y), 0.0), 15.0).to(tl.int32)
        even, odd = tl.split(tl.reshape(levels, (R_PAD, D_PAD // 2, 2)))
        half = tl.arange(0, D_PAD // 2)[None, :]
        tl.store(data + rows[:, None] * (D // 2) + half, (even | (odd << 4)).to(tl.uint8),
                 rmask[:, None] & (half < D // 2))
        if MODE == _BLOCK:
            tl.store(scale + scale_at + offs_d[None, :], scale_h, dmask)
            tl.store(zero + scale_at + offs_d[None, :], zero_h, dmask)
        else:  # one value per group: the group's first channel
            gs = D // GROUPS
            at = rows[:, None] * GROUPS + offs_d[None, :] // gs
            first = mask & (offs_d[None, :] % gs == 0)
            tl.store(scale + at, scale_h, first)
            tl.store(zero + at, zero_h, first)
    else:
        qmax = 127.0 if KIND == _I8 else (448.0 if KIND == _E4M3 else 57344.0)
        if MODE == _BLOCK:  # per channel over the block's tokens (padded rows are 0)
            s = _stored(tl.div_rn(tl.max(tl.abs(x), 0), qmax))
            tl.store(scale + scale_at + offs_d, s, offs_d < D)
            y = tl.div_rn(x, s.to(tl.float32)[None, :])
        else:
            s = _stored(tl.div_rn(tl.max(tl.abs(x), 1), qmax))
            tl.store(scale + rows, s, rmask)
            y = tl.div_rn(x, s.to(tl.float32)[:, None])
        tl.store(data + rows[:, None] * D + offs_d[None, :], _codes8(y, KIND), mask)


@triton.jit
def _write_tokens(k, v, slot_mapping, k_data, k_scale, k_zero, v_data, v_scale, v_zero,
                  k_stride_t, k_stride_h, v_stride_t, v_stride_h, H,
                  D: tl.constexpr, H_PAD: tl.constexpr, D_PAD: tl.constexpr,
                  K_KIND: tl.constexpr, K_GROUPS: tl.constexpr,
                  V_KIND: tl.constexpr, V_GROUPS: tl.constexpr):
    """Token ``t``'s K (side 0) or V (side 1) rows ``[H, D]``, quantized per token-head,
    into pool slot ``slot_mapping[t]``."""
    t, side = tl.program_id(0), tl.program_id(1)
    offs_h, offs_d = tl.arange(0, H_PAD), tl.arange(0, D_PAD)
    rows = tl.load(slot_mapping + t) * H + offs_h
    rmask = offs_h < H
    mask = rmask[:, None] & (offs_d[None, :] < D)
    if side == 0:
        x = tl.load(k + t * k_stride_t + offs_h[:, None] * k_stride_h + offs_d[None, :],
                    mask=mask, other=0).to(tl.float32)
        _encode_store(x, rows, rmask, k_data, k_scale, k_zero, 0, H, D, H_PAD, D_PAD,
                      K_KIND, _TOKEN, K_GROUPS)
    else:
        x = tl.load(v + t * v_stride_t + offs_h[:, None] * v_stride_h + offs_d[None, :],
                    mask=mask, other=0).to(tl.float32)
        _encode_store(x, rows, rmask, v_data, v_scale, v_zero, 0, H, D, H_PAD, D_PAD,
                      V_KIND, _TOKEN, V_GROUPS)


@triton.jit
def _store_blocks(staged_k, staged_v, slots, block_ids, k_data, k_scale, k_zero,
                  v_data, v_scale, v_zero, H, BS: tl.constexpr, BS_PAD: tl.constexpr,
                  D: tl.constexpr, D_PAD: tl.constexpr, K_KIND: tl.constexpr,
                  K_MODE: tl.constexpr, K_GROUPS: tl.constexpr, V_KIND: tl.constexpr,
                  V_MODE: tl.constexpr, V_GROUPS: tl.constexpr):
    """Head ``h`` of staged block ``slots[i]`` (K: side 0, V: side 1), all ``BS`` tokens,
    quantized into pool block ``block_ids[i]``."""
    i, h, side = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot, blk = tl.load(slots + i), tl.load(block_ids + i)
    offs_t, offs_d = tl.arange(0, BS_PAD), tl.arange(0, D_PAD)
    rows = (blk * BS + offs_t) * H + h
    rmask = offs_t < BS
    at = ((slot * BS + offs_t) * H + h)[:, None] * D + offs_d[None, :]
    mask = rmask[:, None] & (offs_d[None, :] < D)
    scale_at = (blk * H + h) * D
    if side == 0:
        x = tl.load(staged_k + at, mask=mask, other=0).to(tl.float32)
        _encode_store(x, rows, rmask, k_data, k_scale, k_zero, scale_at, H, D, BS_PAD, D_PAD,
                      K_KIND, K_MODE, K_GROUPS)
    else:
        x = tl.load(staged_v + at, mask=mask, other=0).to(tl.float32)
        _encode_store(x, rows, rmask, v_data, v_scale, v_zero, scale_at, H, D, BS_PAD, D_PAD,
                      V_KIND, V_MODE, V_GROUPS)


def _pad(n: int) -> int:
    return triton.next_power_of_2(n)


def write_tokens(k_side: TritonSide, v_side: TritonSide, k: Tensor, v: Tensor,
                 slot_mapping: Tensor) -> None:
    """Quantize ``k``/``v [T, H, D]`` (any float dtype; the last axis contiguous) and store
    token ``t`` at ``slot_mapping[t]`` (int64): :meth:`PagedKVCache.write` of one layer."""
    if fmt.BLOCK in (k_side.scale_mode, v_side.scale_mode):
        raise ValueError("per-block scales are written block by block (store_blocks)")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1, "the head dim must be contiguous"
    _write_tokens[(num_tokens, 2)](
        k, v, slot_mapping, *k_side.pointers(), *v_side.pointers(), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), num_heads, D=head_dim, H_PAD=_pad(num_heads),
        D_PAD=_pad(head_dim), K_KIND=k_side.kind, K_GROUPS=k_side.groups, V_KIND=v_side.kind,
        V_GROUPS=v_side.groups)


def store_blocks(k_side: TritonSide, v_side: TritonSide, staged_k: Tensor, staged_v: Tensor,
                 slots: Tensor, block_ids: Tensor) -> None:
    """Quantize the full staged blocks ``staged_k/v[slots[i]]`` (``[num_slots, block_size,
    H, D]``, contiguous) into pool blocks ``block_ids[i]``: :meth:`Staging.store_filled` of
    one layer (``slots[filled]``, ``block_ids[filled]``)."""
    if len(block_ids) == 0:
        return
    _, block_size, num_heads, head_dim = staged_k.shape
    assert staged_k.is_contiguous() and staged_v.is_contiguous()
    _store_blocks[(len(block_ids), num_heads, 2)](
        staged_k, staged_v, slots, block_ids, *k_side.pointers(), *v_side.pointers(),
        num_heads, BS=block_size, BS_PAD=_pad(block_size), D=head_dim, D_PAD=_pad(head_dim),
        K_KIND=k_side.kind, K_MODE=k_side.scale_mode, K_GROUPS=k_side.groups,
        V_KIND=v_side.kind, V_MODE=v_side.scale_mode, V_GROUPS=v_side.groups)
