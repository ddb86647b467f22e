"""Paged decode attention in Triton: one query token per sequence over its quantized pool
pages, read in place (split-K flash-decoding; same semantics as slimkv/kernels/paged_decode.c).

Stage 1, :func:`_decode_split`, grid (sequence, KV head, split): a program walks its split's
blocks through the block table; each page's K and V rows of its KV head are loaded once for
all G query heads of that head (GQA shares one read), dequantized in registers, and
attended with a float32 online softmax. It writes the split's normalised output and its
log-sum-exp. A staged cache's last (partial) block comes from the staging slot at full
precision instead of the pool. Stage 2, :func:`_merge_splits`, grid (sequence, query head):
merges the splits by log-sum-exp (skipped when there is one split).
"""

from __future__ import annotations

import triton
import triton.language as tl
import torch
from torch import Tensor

from slimkv.kernels.triton import side as fmt
from slimkv.kernels.triton.interpret import fix_loop_bounds
from slimkv.kernels.triton.side import TritonSide

fix_loop_bounds()  # Triton 3.6's interpreter: loops over runtime bounds (interpret.py)

_E4M3, _E5M2, _U4 = (tl.constexpr(k) for k in (fmt.E4M3, fmt.E5M2, fmt.U4))
_TOKEN, _BLOCK = tl.constexpr(fmt.TOKEN), tl.constexpr(fmt.BLOCK)


@triton.jit
def _fp8_to_f32(x, M: tl.constexpr, BIAS: tl.constexpr):
    """fp8 bytes (M mantissa bits, exponent bias BIAS) as float32, exactly, in integer steps
    (no fp8 type needed, any GPU): significand times a power of two built from its bits."""
    x = x.to(tl.int32)
    e = (x & 0x7F) >> M
    nz = (e != 0).to(tl.int32)
    significand = ((x & ((1 << M) - 1)) | (nz << M)).to(tl.float32)
    power = ((e - nz - (BIAS + M - 1) + 127) << 23).to(tl.float32, bitcast=True)
    return (1.0 - 2.0 * (x >> 7).to(tl.float32)) * significand * power


@triton.jit
def _pool_rows(data, scale, zero, blk, h, H, offs_t, offs_d, mask,
               BS: tl.constexpr, D: tl.constexpr, KIND: tl.constexpr, MODE: tl.constexpr,
               GROUPS: tl.constexpr):
    """Rows ``offs_t`` of pool block ``blk``, head ``h`` of one side, dequantized: [T, D] f32."""
    row = (blk * BS + offs_t) * H + h
    if KIND == _U4:  # two channels per byte, the even one in the low nibble
        byte = tl.load(data + row[:, None] * (D // 2) + offs_d[None, :] // 2, mask=mask, other=0)
        x = ((byte.to(tl.int32) >> ((offs_d[None, :] & 1) * 4)) & 15).to(tl.float32)
    else:
        x = tl.load(data + row[:, None] * D + offs_d[None, :], mask=mask, other=0)
        if KIND == _E4M3:
            x = _fp8_to_f32(x, 3, 7)
        elif KIND == _E5M2:
            x = _fp8_to_f32(x, 2, 15)
        else:
            x = x.to(tl.float32)
    if MODE == _BLOCK:  # per (block, head, channel)
        at = ((blk * H + h) * D + offs_d)[None, :]
        smask = offs_d[None, :] < D
    elif GROUPS == 1:  # one scale per token-head
        at = row[:, None]
        smask = mask
    else:  # int4 groups along the head dim
        at = row[:, None] * GROUPS + offs_d[None, :] // (D // GROUPS)
        smask = mask
    if MODE == _TOKEN or MODE == _BLOCK:
        x = x * tl.load(scale + at, mask=smask, other=0).to(tl.float32)
        if KIND == _U4:  # masked rows stay 0: a staged own block adds its staged rows
            x = tl.where(mask, x + tl.load(zero + at, mask=smask, other=0).to(tl.float32), 0.0)
    return x


@triton.jit
def _attend_rows(q, k, v, tmask, m, l, acc):
    """Online-softmax step of queries ``q [G, D]`` (pre-scaled) over rows ``k, v [T, D]``
    (``tmask``: the valid ones): the running max ``m``, sum ``l`` and output ``acc``."""
    s = tl.dot(q, tl.trans(k), input_precision="ieee")
    s = tl.where(tmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    return m_new, l, acc


# Integer arguments that change as tables grow or the batch changes are not specialized
# (Triton otherwise compiles a variant per "== 1" and "% 16 == 0" of each): a warm GPU
# never compiles inside a timed decode window.
@triton.jit(do_not_specialize=["table_stride", "blocks_per_split", "num_splits", "sink_from",
                               "sink_shift"])
def _decode_split(q, o_parts, lse_parts, tables, seq_lens, k_data, k_scale, k_zero,
                  v_data, v_scale, v_zero, staged_k, staged_v, slots, sm_scale, H,
                  table_stride, blocks_per_split, num_splits, sink_from, sink_shift,
                  BS: tl.constexpr, BS_PAD: tl.constexpr, D: tl.constexpr,
                  D_PAD: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                  K_KIND: tl.constexpr, K_MODE: tl.constexpr, K_GROUPS: tl.constexpr,
                  V_KIND: tl.constexpr, V_MODE: tl.constexpr, V_GROUPS: tl.constexpr,
                  STAGED: tl.constexpr):
    """Split ``s`` of sequence ``b``, KV head ``h``: its G query heads over blocks
    ``[s * blocks_per_split, (s + 1) * blocks_per_split)``; writes ``o_parts[b, head, s]``
    (the split's softmax-normalised output) and ``lse_parts[b, head, s]``. A block whose
    id is ``>= sink_from`` is a float sink block (docs/kv-formats.md): its rows come from
    staging row ``id + sink_shift``, as the own block's from its slot."""
    b, h, s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    nblocks = (seq_len + BS - 1) // BS
    own = (seq_len - 1) // BS if STAGED else nblocks  # the staged block, else none
    start = s * blocks_per_split
    end = tl.minimum(start + blocks_per_split, nblocks)
    offs_g, offs_t, offs_d = tl.arange(0, G_PAD), tl.arange(0, BS_PAD), tl.arange(0, D_PAD)
    heads = h * G + offs_g
    dmask = offs_d[None, :] < D
    qmask = (offs_g[:, None] < G) & dmask
    qt = tl.load(q + (b * H * G + heads)[:, None] * D + offs_d[None, :], mask=qmask, other=0)
    qt = qt * sm_scale
    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    slot = tl.load(slots + b) if STAGED else 0
    for j in range(start, end):
        blk = tl.load(tables + b * table_stride + j)
        n = tl.minimum(seq_len - j * BS, BS)
        tmask = offs_t < n
        staged = (j == own) | (blk >= sink_from)  # the own block or a sink: no pool rows
        mask = (offs_t < tl.where(staged, 0, n))[:, None] & dmask
        k = _pool_rows(k_data, k_scale, k_zero, blk, h, H, offs_t, offs_d, mask, BS, D,
                       K_KIND, K_MODE, K_GROUPS)
        v = _pool_rows(v_data, v_scale, v_zero, blk, h, H, offs_t, offs_d, mask, BS, D,
                       V_KIND, V_MODE, V_GROUPS)
        if STAGED:  # their rows from the staging buffer (predicated loads: no branch)
            mask = (offs_t < tl.where(staged, n, 0))[:, None] & dmask
            row = tl.where(j == own, slot, blk + sink_shift)
            at = ((row * BS + offs_t) * H + h)[:, None] * D + offs_d[None, :]
            k += tl.load(staged_k + at, mask=mask, other=0).to(tl.float32)
            v += tl.load(staged_v + at, mask=mask, other=0).to(tl.float32)
        m, l, acc = _attend_rows(qt, k, v, tmask, m, l, acc)
    part = (b * H * G + heads) * num_splits + s
    keep = offs_g < tl.where(start < end, G, 0)  # an empty split stores nothing
    l = tl.where(l > 0, l, 1.0)  # finite in empty splits
    tl.store(lse_parts + part, m + tl.log(l), mask=keep)
    tl.store(o_parts + part[:, None] * D + offs_d[None, :], acc / l[:, None],
             mask=keep[:, None] & dmask)


@triton.jit(do_not_specialize=["blocks_per_split", "num_splits"])
def _merge_splits(o_parts, lse_parts, out, seq_lens, blocks_per_split, num_splits,
                  BS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                  S_PAD: tl.constexpr):
    """Query head ``i`` of sequence ``b``: its splits' outputs weighted by
    ``exp(lse - max lse)`` (the splits the sequence's length reaches), normalised."""
    b, i = tl.program_id(0), tl.program_id(1)
    seq_len = tl.load(seq_lens + b)
    used = ((seq_len + BS - 1) // BS + blocks_per_split - 1) // blocks_per_split
    offs_s, offs_d = tl.arange(0, S_PAD), tl.arange(0, D_PAD)
    part = (b * tl.num_programs(1) + i) * num_splits + offs_s
    lse = tl.load(lse_parts + part, mask=offs_s < used, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    o = tl.load(o_parts + part[:, None] * D + offs_d[None, :],
                mask=(offs_s[:, None] < used) & (offs_d[None, :] < D), other=0)
    tl.store(out + (b * tl.num_programs(1) + i) * D + offs_d,
             tl.sum(w[:, None] * o, 0) / tl.sum(w, 0), mask=offs_d < D)


NO_SINK = 2**31 - 1  # sink_from of a cache without a sink: no block id reaches it


def _pad(n: int, least: int = 1) -> int:
    return max(least, triton.next_power_of_2(n))


class TritonDecode:
    """Paged decode attention on the tensors' device; :meth:`__call__` as
    :class:`slimkv.kernels.DecodeKernel`'s, with :class:`TritonSide` sides.

    A sequence is split into parts of ``blocks_per_split`` blocks (given, else chosen so
    that (sequence, KV head, split) programs number about ``target_programs``, each at least
    ``min_split_tokens`` long), merged by log-sum-exp.
    """

    def __init__(self, blocks_per_split: int | None = None, target_programs: int = 1024,
                 min_split_tokens: int = 256) -> None:
        self.blocks_per_split = blocks_per_split
        self.target_programs = target_programs
        self.min_split_tokens = min_split_tokens

    def split(self, batch: int, num_kv_heads: int, max_blocks: int, block_size: int) -> int:
        """Blocks per split for a batch whose block tables have ``max_blocks`` columns."""
        if self.blocks_per_split is not None:
            return self.blocks_per_split
        splits = max(1, self.target_programs // max(1, batch * num_kv_heads))
        least = -(-self.min_split_tokens // block_size)
        return max(least, -(-max_blocks // splits))

    def __call__(self, q: Tensor, block_tables: Tensor, seq_lens: Tensor, k: TritonSide,
                 v: TritonSide, num_kv_heads: int, block_size: int, scale: float,
                 staged: tuple[Tensor, Tensor, Tensor] | None,
                 sink: tuple[int, int] | None = None) -> Tensor:
        """``q [B, Hq, D]`` (float32) over the blocks of ``block_tables [B, m]`` (int64) up to
        ``seq_lens [B]`` (each >= 1); ``staged``: (staged K, staged V ``[slots, block_size,
        H, D]``, slot per sequence ``[B]``) for a staged cache, whose last block is read from
        there; ``sink``: (first sink id, its staging row's shift) where the cache keeps
        block 0 at float (:class:`slimkv.kv.staging.Staging`). Returns float32 ``[B, Hq, D]``."""
        batch, num_heads, head_dim = q.shape
        q, block_tables = q.float().contiguous(), block_tables.contiguous()
        per = self.split(batch, num_kv_heads, block_tables.shape[1], block_size)
        num_splits = -(-block_tables.shape[1] // per)
        o_parts = torch.empty(batch, num_heads, num_splits, head_dim, device=q.device)
        lse_parts = torch.empty(batch, num_heads, num_splits, device=q.device)
        staged_k, staged_v, slots = staged if staged is not None else (q, q, seq_lens)
        group = num_heads // num_kv_heads
        _decode_split[(batch, num_kv_heads, num_splits)](
            q, o_parts, lse_parts, block_tables, seq_lens, *k.pointers(), *v.pointers(),
            staged_k, staged_v, slots, scale, num_kv_heads, block_tables.stride(0), per,
            num_splits, *(sink or (NO_SINK, 0)), BS=block_size, BS_PAD=_pad(block_size, 16), D=head_dim,
            D_PAD=_pad(head_dim, 16), G=group, G_PAD=_pad(group, 16), K_KIND=k.kind,
            K_MODE=k.scale_mode, K_GROUPS=k.groups, V_KIND=v.kind, V_MODE=v.scale_mode,
            V_GROUPS=v.groups, STAGED=staged is not None)
        if num_splits == 1:
            return o_parts.view(batch, num_heads, head_dim)
        out = torch.empty(batch, num_heads, head_dim, device=q.device)
        _merge_splits[(batch, num_heads)](o_parts, lse_parts, out, seq_lens, per, num_splits,
                                          BS=block_size, D=head_dim, D_PAD=_pad(head_dim),
                                          S_PAD=_pad(num_splits))
        return out
