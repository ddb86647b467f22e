"""Prefill attention: one sequence's chunk of queries over its context, one SDPA call.

What a chunk's queries may see depends on positions only, so it is the same in every
layer: :func:`prefill_mask` is built once per step (the runner's metadata keeps it) and
every layer reuses it. It is an *additive* mask in the model dtype (0 or -inf): SDPA turns
a bool mask into that form on every call, which cost as much as the attention itself at
512 queries. A chunk that starts the sequence on an unstaged cache needs no mask at all
(``is_causal``). The query heads sharing a KV head are expanded by SDPA itself
(``enable_gqa``), so the mask stays ``[query_len, keys]`` for every head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slimkv.kv.staging import StagedKV, staged_mask

__all__ = ["additive", "attend", "context_mask", "prefill_mask"]


def context_mask(seq_lens: Tensor, query_len: int, num_keys: int) -> Tensor:
    """``[B, query_len, num_keys]`` bool, True where a query may attend a key.

    Query ``i`` of a sequence of length ``L`` sits at absolute position ``L - query_len + i``
    and sees keys at or before it, so padding past ``L`` (block tails, padded block tables
    of shorter sequences) is never attended.
    """
    query_pos = seq_lens[:, None] - query_len + torch.arange(query_len, device=seq_lens.device)
    key_pos = torch.arange(num_keys, device=seq_lens.device)
    return key_pos[None, None, :] <= query_pos[:, :, None]


def additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask as SDPA's additive form: 0 where True, -inf where False."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        ~mask, float("-inf"))


def prefill_mask(seq_len: int, query_len: int, num_pool_keys: int, staged: StagedKV | None,
                 block_size: int, dtype: torch.dtype, device: torch.device) -> Tensor | None:
    """The additive mask ``[query_len, keys]`` of one sequence's chunk, or None where the
    keys are its first ``seq_len`` pool keys and the chunk is the whole sequence (causal).

    Keys are the pool's ``num_pool_keys`` (block padding included), then, for a staged
    cache, ``staged``'s full-precision tokens (see :meth:`Staging.context`)."""
    if staged is not None:
        return additive(staged_mask(seq_len, query_len, num_pool_keys, staged.start,
                                    len(staged.k), block_size, device), dtype)
    if query_len == seq_len:
        return None
    seq_lens = torch.tensor([seq_len], device=device)
    return additive(context_mask(seq_lens, query_len, num_pool_keys)[0], dtype)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """``q [n, Hq, D]`` over ``k, v [L, H_kv, D]`` with an additive ``mask [n, L]``, or
    causal over the first ``n`` keys when ``mask`` is None -> ``[n, Hq, D]``."""
    if mask is None:
        k, v = k[:len(q)], v[:len(q)]
    # 4-d (batch 1): CPU SDPA takes its flash kernel only for 4-d inputs.
    q, k, v = (x.transpose(0, 1)[None] for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                         scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)
