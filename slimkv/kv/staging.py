"""The staging block: each running sequence's last block in full precision.

Per-channel key scales are computed over all ``block_size`` tokens of a block, so a block
can only be quantized once it is full. Until then its tokens live here, one staging slot
per running sequence (the KV manager hands slots out); when a write fills the block, the
whole block is quantized into the pool. The slot keeps holding that block (now full) until
the next token starts a new one, so the token that completed it still sees its own block at
full precision.

Attention therefore follows one rule, whatever the chunking: a query sees the blocks
before its own through the quantized pool and its own block at full precision. Prefix-cached
blocks are full, hence always quantized.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from slimkv.kv.cache import PagedKVCache


class Staging:
    """``buffer [2 (K, V), num_layers, num_slots, block_size, H, D]`` in the model dtype."""

    def __init__(self, cache: PagedKVCache, num_slots: int, dtype: torch.dtype) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.buffer = torch.zeros(2, cache.num_layers, num_slots, cache.block_size,
                                  cache.num_kv_heads, cache.head_dim, dtype=dtype,
                                  device=cache.device)

    @staticmethod
    def bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
              num_slots: int, dtype: torch.dtype) -> int:
        """What :attr:`buffer` occupies (for the planner, before any cache exists)."""
        return 2 * num_layers * num_slots * block_size * num_kv_heads * head_dim * dtype.itemsize

    def append(self, layer: int, slot: int, start: int, block_ids: Tensor, k: Tensor,
               v: Tensor) -> tuple[Tensor, Tensor]:
        """Add one sequence's tokens at positions ``[start, start + n)``; ``block_ids`` are its
        blocks from ``start // block_size`` on. Blocks this fills go into the pool.

        Returns K and V at full precision from the start of ``start``'s block to the last
        new token: every query of this step finds its own block in there.
        """
        bs = self.block_size
        held = start % bs
        k_ctx, v_ctx = (torch.cat((self.buffer[side, layer, slot, :held], x.to(self.buffer.dtype)))
                        for side, x in enumerate((k, v)))
        num_full = len(k_ctx) // bs
        if num_full:
            self.cache.write_blocks(layer, block_ids[:num_full],
                                    k_ctx[:num_full * bs].unflatten(0, (num_full, bs)),
                                    v_ctx[:num_full * bs].unflatten(0, (num_full, bs)))
        last = (len(k_ctx) - 1) // bs * bs
        for side, ctx in enumerate((k_ctx, v_ctx)):
            self.buffer[side, layer, slot, :len(ctx) - last] = ctx[last:]
        return k_ctx, v_ctx

    def append_decodes(self, layer: int, slots: Tensor, positions: Tensor, block_ids: Tensor,
                       k: Tensor, v: Tensor) -> None:
        """One token per sequence at once: token ``i`` at ``positions[i]`` of the block
        ``block_ids[i]``, staged in ``slots[i]``."""
        offsets = positions % self.block_size
        for side, x in enumerate((k, v)):
            self.buffer[side, layer, slots, offsets] = x.to(self.buffer.dtype)
        full = offsets == self.block_size - 1
        if bool(full.any()):
            blocks = self.buffer[:, layer, slots[full]]
            self.cache.write_blocks(layer, block_ids[full], blocks[0], blocks[1])

    def own_blocks(self, layer: int, slots: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """K and V ``[B, block_size, H, D]`` of each slot's block."""
        blocks = self.buffer[:, layer, slots].to(dtype)
        return blocks[0], blocks[1]
