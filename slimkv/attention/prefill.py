"""Prefill attention: one sequence's chunk of queries over its context, in a few SDPA calls.

What a query may see depends on positions only (:func:`slimkv.kv.staging.staged_mask`,
:func:`context_mask`), so it is the same in every layer: :func:`plan` runs once per step
(the step's metadata keeps it) and every layer reuses it. The chunk's queries are cut into
*pieces* of ``PIECE`` positions; a piece attends only the keys some of its queries can see
(the pool blocks before its last block, plus, with a staged cache, the full-precision
tokens from its first block on), so a 512-token chunk does ~causal work instead of
attending every key of the sequence (twice for a staged cache: pool and staged) under a
mask. Each piece's mask is *additive* (0 / -inf) in the model dtype: SDPA turns a bool
mask into that form on every call, which cost as much as the attention itself. A chunk
that starts the sequence on an unstaged cache is one causal call without a mask. The query
heads sharing a KV head are expanded by SDPA itself (``enable_gqa``); a bf16 chunk on a CPU
with AVX512-BF16 makes each call in slimkv's own kernel instead (:func:`attend`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from slimkv.kernels.prefill_attn import prefill_kernel
from slimkv.kv.staging import StagedKV, staged_mask

__all__ = ["PIECE", "Piece", "attend", "context_mask", "plan", "run"]

# Query positions per SDPA call (a multiple of the block size).
PIECE = 128


def context_mask(seq_lens: Tensor, query_len: int, num_keys: int) -> Tensor:
    """``[B, query_len, num_keys]`` bool, True where a query may attend a key.

    Query ``i`` of a sequence of length ``L`` sits at absolute position ``L - query_len + i``
    and sees keys at or before it, so padding past ``L`` (block tails, padded block tables
    of shorter sequences) is never attended.
    """
    query_pos = seq_lens[:, None] - query_len + torch.arange(query_len, device=seq_lens.device)
    key_pos = torch.arange(num_keys, device=seq_lens.device)
    return key_pos[None, None, :] <= query_pos[:, :, None]


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as SDPA's additive form: 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


@dataclass(slots=True, frozen=True)
class Piece:
    """Query rows ``rows`` of a chunk attend pool keys ``[0, num_pool_keys)`` then the
    staged tokens ``staged`` (indices into :class:`StagedKV`; None: unstaged cache), under
    the additive ``mask [rows, keys]``, or causally over the first ``len(rows)`` pool keys
    when ``mask`` is None."""

    rows: slice
    num_pool_keys: int
    staged: slice | None
    mask: Tensor | None


def plan(seq_len: int, query_len: int, staged_start: int | None, block_size: int,
         dtype: torch.dtype, device: torch.device, piece: int | None = None) -> list[Piece]:
    """The pieces (of ``piece`` positions, default :data:`PIECE`) of the chunk of a
    ``seq_len``-token sequence's last ``query_len`` tokens; ``staged_start``:
    :attr:`StagedKV.start` for a staged cache, else None."""
    piece = piece or PIECE
    start = seq_len - query_len
    if staged_start is None and start == 0:
        return [Piece(slice(0, query_len), query_len, None, None)]
    pieces = []
    for first in range(start, seq_len, piece):
        last = min(first + piece, seq_len)  # positions [first, last)
        rows = slice(first - start, last - start)
        if staged_start is None:
            mask = context_mask(torch.tensor([last], device=device), last - first, last)[0]
            pieces.append(Piece(rows, last, None, _additive(mask, dtype)))
            continue
        own = first // block_size * block_size  # the first query's block: staged from here
        pool = (last - 1) // block_size * block_size  # the last query's block: pool before it
        mask = staged_mask(last, last - first, pool, own, last - own, block_size, device)
        pieces.append(Piece(rows, pool, slice(own - staged_start, last - staged_start),
                            _additive(mask, dtype)))
    return pieces


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """``q [n, Hq, D]`` over ``k, v [L, H_kv, D]`` with an additive ``mask [n, L]``, or
    causal over the first ``n`` keys when ``mask`` is None -> ``[n, Hq, D]``. A bf16 chunk
    on a CPU with AVX512-BF16 takes :mod:`slimkv.kernels.prefill_attn` (~3x torch's flash
    kernel at 512 causal tokens on two Zen 4 cores), everything else torch's SDPA."""
    if mask is None:
        k, v = k[:len(q)], v[:len(q)]
    if q.dtype == torch.bfloat16 and q.device.type == "cpu":
        kernel = prefill_kernel()
        if kernel is not None and kernel.takes(q, k, v, mask):
            return kernel(q, k, v, mask, scale)
    # 4-d (batch 1): CPU SDPA takes its flash kernel only for 4-d inputs.
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def run(pieces: list[Piece], q: Tensor, k: Tensor, v: Tensor, staged: StagedKV | None,
        scale: float) -> Tensor:
    """A chunk's ``q [n, Hq, D]`` over its pool keys ``k, v [L, H_kv, D]`` (and ``staged``)
    piece by piece -> ``[n, Hq, D]``."""
    out = None if len(pieces) == 1 else torch.empty_like(q)
    for p in pieces:
        pk, pv = k[:p.num_pool_keys], v[:p.num_pool_keys]
        if p.staged is not None:
            pk = torch.cat((pk, staged.k[p.staged].to(k.dtype)))
            pv = torch.cat((pv, staged.v[p.staged].to(v.dtype)))
        y = attend(q[p.rows], pk, pv, p.mask, scale)
        if out is None:
            return y
        out[p.rows] = y
    return out
