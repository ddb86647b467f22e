"""Paged prefill ("extend") attention in Triton: one sequence's chunk of queries over its
context, the quantized pool pages read in place (no float copy of the prefix).

A chunk is the last ``n`` tokens of a ``seq_len``-token sequence: query ``i`` sits at
position ``p = seq_len - n + i``. What it sees is the engine's rule
(:func:`slimkv.attention.prefill.plan`, :func:`slimkv.kv.staging.staged_mask`), by
positions only:

* unstaged cache (per-token scales or float pages; the chunk's K/V already written): pool
  keys at positions ``[0, p]``;
* staged cache (keys with per-channel-block scales): pool keys of the blocks before its own,
  ``[0, own(p))`` with ``own(p) = p // block_size * block_size``, then the chunk's
  full-precision tokens (:class:`slimkv.kv.staging.StagedKV`, from ``staged.start``) at
  ``[own(p), p]``.

:func:`_prefill`, grid (row tile, KV head): a tile's rows are the chunk's (position, query
head) pairs of one KV head, position-major (row ``i * G + g``: query ``i``, head
``h * G + g``), ``ROWS`` of them, so the ``G`` query heads of a KV head share every K/V row
a tile reads and ``G`` is never padded to a power of two. Loop 1 walks the pool blocks the
tile's last query can see through the block table, each dequantized in registers by the
decode kernel's row loader (:func:`slimkv.kernels.triton.decode._pool_rows`: float pages,
int8 / fp8 e4m3 / e5m2 with float16 per-token or per-(block, head, channel) scales, int4
with scale and zero); loop 2 (staged only) walks the staged tokens from the own block of
the tile's first query. Softmax is float32 and online; the per-row masks come from
positions. Dot operands are q's dtype: float32 (IEEE, as the tests run it) or fp16/bf16
(tensor cores, float32 accumulation: K, V and the probabilities rounded to q's dtype, as
the engine's SDPA path rounds K and V today). The output is in q's dtype.

Under Triton's interpreter (CPU tests) a bfloat16 ``tl.dot`` is wrong (numpy has no
bfloat16), so bf16 queries are checked on a GPU only; float32 and float16 queries run there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from slimkv.kernels.triton import side as fmt
from slimkv.kernels.triton.decode import NO_SINK, _pool_rows
from slimkv.kernels.triton.side import TritonSide

__all__ = ["paged_prefill"]


@triton.jit
def _attend(q, k, v, visible, sm_scale, m, l, acc, PREC: tl.constexpr):
    """Online-softmax step of the tile's queries ``q [ROWS, D]`` over rows ``k, v [T, D]``
    (float32), ``visible [ROWS, T]``: the running max ``m``, sum ``l`` and output ``acc``.
    ``m`` starts finite (-1e30), so a row that sees nothing yet keeps ``alpha = 1, p = 0``."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PREC) * sm_scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PREC)
    return m_new, l, acc


# Lengths change every chunk: not specialized, so Triton compiles no variant per value class
# ("== 1", "% 16 == 0") inside a timed window.
@triton.jit(do_not_specialize=["seq_len", "n", "staged_start", "num_staged", "sink_from",
                               "sink_shift"])
def _prefill(q, out, table, k_data, k_scale, k_zero, v_data, v_scale, v_zero, staged_k,
             staged_v, seq_len, n, staged_start, num_staged, sm_scale, H, sink_k, sink_v,
             sink_from, sink_shift,
             ROWS: tl.constexpr, BS: tl.constexpr, BS_PAD: tl.constexpr, D: tl.constexpr,
             D_PAD: tl.constexpr, G: tl.constexpr,
             K_KIND: tl.constexpr, K_MODE: tl.constexpr, K_GROUPS: tl.constexpr,
             V_KIND: tl.constexpr, V_MODE: tl.constexpr, V_GROUPS: tl.constexpr,
             STAGED: tl.constexpr, PREC: tl.constexpr):
    """Rows ``[tile * ROWS, (tile + 1) * ROWS)`` of KV head ``h``'s ``n * G`` query rows:
    ``q, out [n, H * G, D]``; ``table`` the sequence's block ids; ``staged_k, staged_v
    [num_staged, H, D]`` from position ``staged_start`` (STAGED); a pool block whose id is
    ``>= sink_from`` is read from row ``id + sink_shift`` of ``sink_k, sink_v`` (the layer's
    staging buffers: its float sink block)."""
    tile, h = tl.program_id(0), tl.program_id(1)
    f = tile * ROWS + tl.arange(0, ROWS)
    valid = f < n * G
    pos = seq_len - n + f // G  # each row's query position
    p_lo = seq_len - n + tile * ROWS // G  # the tile's first and last query positions
    p_hi = seq_len - n + (tl.minimum(tile * ROWS + ROWS, n * G) - 1) // G
    own = pos // BS * BS  # the start of each row's own block
    offs_t, offs_d = tl.arange(0, BS_PAD), tl.arange(0, D_PAD)
    dmask = offs_d[None, :] < D
    qrow = (f // G * H + h) * G + f % G  # row of q viewed as [n * Hq, D]
    qt = tl.load(q + qrow[:, None] * D + offs_d[None, :], mask=valid[:, None] & dmask, other=0)
    m = tl.full([ROWS], -1e30, tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D_PAD], tl.float32)
    # Loop 1: pool blocks; staged: those before the last query's own block.
    num_pool = p_hi // BS if STAGED else p_hi // BS + 1
    for j in range(0, num_pool):
        blk = tl.load(table + j)
        kpos = j * BS + offs_t
        rows = (offs_t < BS) & (kpos < seq_len)
        sink = blk >= sink_from  # a sink block: its rows float, from its staging row
        pool = rows & (offs_t < tl.where(sink, 0, BS))
        k = _pool_rows(k_data, k_scale, k_zero, blk, h, H, offs_t, offs_d,
                       pool[:, None] & dmask, BS, D, K_KIND, K_MODE, K_GROUPS)
        v = _pool_rows(v_data, v_scale, v_zero, blk, h, H, offs_t, offs_d,
                       pool[:, None] & dmask, BS, D, V_KIND, V_MODE, V_GROUPS)
        if STAGED:  # predicated loads: no branch
            sink = (rows & (offs_t < tl.where(sink, BS, 0)))[:, None] & dmask
            at = (((blk + sink_shift) * BS + offs_t) * H + h)[:, None] * D + offs_d[None, :]
            k += tl.load(sink_k + at, mask=sink, other=0).to(tl.float32)
            v += tl.load(sink_v + at, mask=sink, other=0).to(tl.float32)
        if STAGED:
            visible = kpos[None, :] < own[:, None]
        else:
            visible = kpos[None, :] <= pos[:, None]
        m, l, acc = _attend(qt, k, v, visible & rows[None, :], sm_scale, m, l, acc, PREC)
    if STAGED:  # loop 2: full-precision tokens from the first query's own block
        for t0 in range(p_lo // BS * BS - staged_start, p_hi - staged_start + 1, BS_PAD):
            idx = t0 + offs_t
            spos = staged_start + idx
            rows = idx < num_staged
            at = (idx * H + h)[:, None] * D + offs_d[None, :]
            k = tl.load(staged_k + at, mask=rows[:, None] & dmask, other=0).to(tl.float32)
            v = tl.load(staged_v + at, mask=rows[:, None] & dmask, other=0).to(tl.float32)
            visible = (spos[None, :] >= own[:, None]) & (spos[None, :] <= pos[:, None])
            m, l, acc = _attend(qt, k, v, visible & rows[None, :], sm_scale, m, l, acc, PREC)
    l = tl.where(l > 0, l, 1.0)  # padding rows only: every query sees itself
    tl.store(out + qrow[:, None] * D + offs_d[None, :],
             (acc / l[:, None]).to(out.dtype.element_ty), mask=valid[:, None] & dmask)


def _pad(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def paged_prefill(q: Tensor, block_table: Tensor, seq_len: int, k_side: TritonSide,
                  v_side: TritonSide, staged=None, scale: float | None = None,
                  block_rows: int = 64, num_warps: int = 4, sink=None) -> Tensor:
    """Attention of one sequence's chunk ``q [n, Hq, D]`` (float32, float16 or bfloat16;
    positions ``seq_len - n .. seq_len - 1``) over its context, on q's device.

    ``block_table``: the sequence's block ids (int64 ``[m]`` or ``[1, m]``, at least
    ``ceil(seq_len / block_size)`` of them; padding past that is never read);
    ``k_side, v_side``: the layer's pool views (:func:`slimkv.kernels.triton.side.describe`),
    holding the chunk's tokens already for an unstaged cache; ``staged``: for a staged cache
    (per-channel-block keys) the chunk's :class:`slimkv.kv.staging.StagedKV` (``start``,
    ``k``, ``v [seq_len - start, H, D]``: anything with those attributes), else None;
    ``scale``: the softmax scale (default ``D ** -0.5``); ``block_rows``: (position, head)
    rows per program, a power of two >= 16; ``sink``: (the layer's staging K, V buffers,
    first sink id, shift to its row) where the cache keeps block 0 at float (staged
    caches only). Returns ``[n, Hq, D]`` in q's dtype."""
    n, num_heads, head_dim = q.shape
    num_kv, bs = k_side.num_kv_heads, k_side.block_size
    if num_heads % num_kv or v_side.num_kv_heads != num_kv or v_side.block_size != bs:
        raise ValueError(f"{num_heads} query heads over {num_kv} KV heads (V: "
                         f"{v_side.num_kv_heads}), block sizes {bs} / {v_side.block_size}")
    for s in (k_side, v_side):
        width = head_dim // 2 if s.kind == fmt.U4 else head_dim
        if s.data.shape[3] != width or s.data.device != q.device:
            raise ValueError(f"a pool side of width {s.data.shape[3]} on {s.data.device} "
                             f"for head_dim {head_dim} on {q.device}")
    if not 1 <= n <= seq_len:
        raise ValueError(f"a chunk of {n} queries in a {seq_len}-token sequence")
    if q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q must be float32, float16 or bfloat16, got {q.dtype}")
    if block_rows < 16 or block_rows & (block_rows - 1):
        raise ValueError(f"block_rows must be a power of two >= 16, got {block_rows}")
    if staged is None and fmt.BLOCK in (k_side.scale_mode, v_side.scale_mode):
        raise ValueError("a cache with per-block scales is staged: pass the chunk's StagedKV")
    table = block_table.reshape(-1).contiguous()
    if len(table) < -(-seq_len // bs):
        raise ValueError(f"{len(table)} block ids for {seq_len} tokens of block size {bs}")
    q = q.contiguous()
    out = torch.empty_like(q)
    if staged is not None:
        start, staged_k, staged_v = staged.start, staged.k.contiguous(), staged.v.contiguous()
        if start % bs or start > seq_len - n or start + len(staged_k) != seq_len or \
                staged_k.shape != staged_v.shape or staged_k.shape[1:] != (num_kv, head_dim):
            raise ValueError(f"staged tokens {tuple(staged_k.shape)} from {start} do not "
                             f"cover the chunk's blocks up to {seq_len}")
    else:
        start, staged_k, staged_v = 0, q, q  # stand-ins, never read
    group = num_heads // num_kv
    rows = min(block_rows, _pad(n * group))
    _prefill[(triton.cdiv(n * group, rows), num_kv)](
        q, out, table, *k_side.pointers(), *v_side.pointers(), staged_k, staged_v, seq_len, n,
        start, len(staged_k) if staged is not None else 0,
        head_dim ** -0.5 if scale is None else scale, num_kv, *(sink or (q, q, NO_SINK, 0)),
        ROWS=rows, BS=bs, BS_PAD=_pad(bs), D=head_dim, D_PAD=_pad(head_dim), G=group,
        K_KIND=k_side.kind, K_MODE=k_side.scale_mode, K_GROUPS=k_side.groups,
        V_KIND=v_side.kind, V_MODE=v_side.scale_mode, V_GROUPS=v_side.groups,
        STAGED=staged is not None, PREC="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps)
    return out
