"""Attention inputs for a staged cache (:mod:`slimkv.kv.staging`): a query sees the blocks
before its own through the quantized pool and its own block at full precision.

Keys are laid out as the sequence's pool blocks followed by its full-precision ("fresh")
tokens, and a mask picks, per query, the right copy of every position. The rule depends on
positions only, so a prompt gives the same result however it is chunked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slimkv.kv.cache import PagedKVCache


@dataclass(slots=True)
class Fresh:
    """A sequence's new K/V at full precision, from ``start`` (the first position of the
    block holding its first new token) to its last token."""

    start: int
    k: Tensor
    v: Tensor


def own_block_mask(seq_len: int, query_len: int, num_pool_keys: int, fresh_start: int,
                   fresh_len: int, block_size: int, device: torch.device) -> Tensor:
    """``[query_len, num_pool_keys + fresh_len]`` bool for keys = pool keys then fresh keys:
    a query sees pool keys of earlier blocks and fresh keys of its own block up to itself."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    own_start = query_pos // block_size * block_size
    pool_pos = torch.arange(num_pool_keys, device=device)[None]
    fresh_pos = fresh_start + torch.arange(fresh_len, device=device)[None]
    return torch.cat((pool_pos < own_start, (fresh_pos >= own_start) & (fresh_pos <= query_pos)), 1)


def staged_context(cache: PagedKVCache, layer: int, block_table: Tensor, seq_len: int,
                   query_len: int, staging_slot: Tensor, fresh: Fresh | None,
                   dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """One sequence's keys, values ``[1, n, H, D]`` (pool blocks of ``block_table [1, m]``,
    then its full-precision tokens) and mask ``[1, query_len, n]``. Without ``fresh`` (a
    decode), its own block comes from its ``staging_slot [1]``."""
    bs = cache.block_size
    if fresh is None:
        start = (seq_len - 1) // bs * bs
        own = cache.staging.own_blocks(layer, staging_slot, dtype)
        fresh = Fresh(start, own[0][0, :seq_len - start], own[1][0, :seq_len - start])
    k, v = cache.read_prefix(layer, block_table, seq_len, dtype)
    mask = own_block_mask(seq_len, query_len, k.shape[1], fresh.start, len(fresh.k), bs, k.device)
    k = torch.cat((k, fresh.k[None].to(dtype)), 1)
    v = torch.cat((v, fresh.v[None].to(dtype)), 1)
    return k, v, mask[None]
