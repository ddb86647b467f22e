"""Staging: each running sequence's last block, at full precision, in front of the pool.

Per-channel key scales (:mod:`slimkv.kv.block_scales`) are computed over all
``block_size`` tokens of a block, so a block can only be quantized once it is full. Until
then its tokens are *staged* here, in the sequence's *staging slot* (the KV manager hands
one out on a sequence's first allocation and takes it back when the sequence is freed);
when a write fills the block, the whole block is quantized into the pool. The slot keeps
that block (now full) until the next token starts a new one, so the token that completed
it still sees its own block at full precision.

Attention therefore follows one rule, whatever the chunking: a query sees the blocks
before its own through the quantized pool and its own block at full precision (from the
staging slot for a decode; for a prefill chunk, from :class:`StagedKV`, the chunk's own
tokens after the staged head of its first block). The rule depends on positions only, so
a prompt gives the same result however it is chunked. Prefix-cached blocks are full,
hence always quantized, except a sequence's first block where the cache keeps a *sink*:
then block 0 (ids from ``sink_from`` on, :class:`slimkv.kv.block_pool.BlockPool`) is read
from its float row here, ``num_slots + id - sink_from``, once it is full (docs/kv-formats.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from slimkv.kv.cache import PagedKVCache
from slimkv.kv.layers import LayerDtypes, dtype_pairs, side_codec

# The float sink region (kv_cache.int4.sink_block) holds two blocks per staging slot (each
# running sequence's block 0, as many again for cached heads) in at most 1/SINK_SHARE of the
# KV budget, each a float row here and a pool block; past it block 0 is quantized like the rest.
SINK_SHARE = 16

@dataclass(slots=True)
class StagedKV:
    """One sequence's K and V ``[n, H, D]`` at full precision, from ``start`` (the first
    position of the block holding its first new token) to its last token."""

    start: int
    k: Tensor
    v: Tensor


class Staging:
    """The staging slots of one :class:`PagedKVCache`: ``buffer [2 (K, V), num_layers,
    num_slots + num_sink, block_size, H, D]`` in the model dtype, the float sink rows after
    the slots. Full blocks go into ``cache`` (sink blocks also into their rows)."""

    def __init__(self, cache: PagedKVCache, num_slots: int, dtype: torch.dtype,
                 num_sink: int = 0) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self.buffer = torch.zeros(2, cache.num_layers, num_slots + num_sink, cache.block_size,
                                  cache.num_kv_heads, cache.head_dim, dtype=dtype,
                                  device=cache.device)
        # Sink id b (from sink_from on) has row b + sink_shift.
        self.num_sink, self.sink_from = num_sink, cache.num_blocks - num_sink
        self.sink_shift = num_slots - self.sink_from
        self._layers = [(self.buffer[0, i], self.buffer[1, i]) for i in range(cache.num_layers)]

    @staticmethod
    def needed(k_dtype: str, v_dtype: str, head_dim: int, k_scale: str,
               layer_dtypes: LayerDtypes | None = None) -> bool:
        """Whether a key codec has per-block scales, so partial blocks must be staged (the
        default dtypes count even when ``layer_dtypes`` overrides every layer)."""
        return any(side_codec(k, head_dim, k_scale).block_aux_widths
                   for k, _ in dtype_pairs(k_dtype, v_dtype, layer_dtypes))

    @staticmethod
    def bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int,
              num_slots: int, dtype: torch.dtype) -> int:
        """What :attr:`buffer` occupies (for sizing, before any cache exists)."""
        return 2 * num_layers * num_slots * block_size * num_kv_heads * head_dim * dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.buffer.nbytes

    # -- writes --------------------------------------------------------------------------

    def append(self, layer: int, slot: int, start: int, block_ids: Tensor, k: Tensor,
               v: Tensor) -> StagedKV:
        """Add one sequence's tokens at positions ``[start, start + n)``; ``block_ids`` are its
        blocks from ``start // block_size`` on. Blocks this fills go into the pool.

        Returns K and V at full precision from the start of ``start``'s block to the last
        new token: every query of this step finds its own block in there."""
        bs = self.block_size
        held = start % bs
        k_ctx, v_ctx = (torch.cat((self.buffer[side, layer, slot, :held], x.to(self.buffer.dtype)))
                        if held else x.to(self.buffer.dtype) for side, x in enumerate((k, v)))
        num_full = len(k_ctx) // bs
        if num_full:
            self.cache.write_blocks(layer, block_ids[:num_full],
                                    k_ctx[:num_full * bs].unflatten(0, (num_full, bs)),
                                    v_ctx[:num_full * bs].unflatten(0, (num_full, bs)))
        if num_full and start < bs and self.num_sink:  # block 0 filled: into a sink id's row
            # (a quantized block 0's go to the slot, overwritten below: no host sync)
            row = torch.where(block_ids[0] >= self.sink_from, block_ids[0] + self.sink_shift, slot)
            self.buffer[:, layer, row] = torch.stack((k_ctx[:bs], v_ctx[:bs]))
        last = (len(k_ctx) - 1) // bs * bs
        for side, ctx in enumerate((k_ctx, v_ctx)):
            self.buffer[side, layer, slot, :len(ctx) - last] = ctx[last:]
        return StagedKV(start - held, k_ctx, v_ctx)

    def append_decodes(self, layer: int, slots: Tensor, offsets: Tensor, block_ids: Tensor,
                       k: Tensor, v: Tensor, filled: Tensor | None) -> None:
        """One token per sequence at once: token ``i`` at ``offsets[i]`` of the block
        ``block_ids[i]``, staged in ``slots[i]``; then :meth:`store_filled`."""
        for side, x in enumerate((k, v)):
            self.buffer[side, layer, slots, offsets] = x.to(self.buffer.dtype)
        self.store_filled(layer, slots, block_ids, filled)

    def store_filled(self, layer: int | None, slots: Tensor, block_ids: Tensor,
                     filled: Tensor | None) -> None:
        """The slots ``slots[filled]`` (indices, or None) hold full blocks: into the pool, of
        one layer or (``layer`` None) of all at once; sink blocks also into their float rows,
        the others onto their own slots (which hold them: no host sync picks the sinks out)."""
        if filled is not None:
            ids, index = block_ids[filled], slots[filled]
            blocks = self.buffer[:, slice(None) if layer is None else layer, index]
            if layer is None:
                self.cache.write_blocks_all_layers(ids, blocks[0], blocks[1])
            else:
                self.cache.write_blocks(layer, ids, blocks[0], blocks[1])
            if self.num_sink:
                rows = torch.where(ids >= self.sink_from, ids + self.sink_shift, index)
                self.buffer[:, slice(None) if layer is None else layer, rows] = blocks

    # -- reads ---------------------------------------------------------------------------

    def blocks(self, layer: int, slots: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """K and V ``[B, block_size, H, D]`` of each slot's block."""
        return tuple(self.buffer[:, layer, slots].to(dtype))

    def layer_buffers(self, layer: int) -> tuple[Tensor, Tensor]:
        """K and V ``[num_slots, block_size, H, D]`` of one layer (for native kernels)."""
        return self._layers[layer]  # views made once: a decode step asks every layer

    def read_prefix(self, layer: int, block_tables: Tensor, num_tokens: int,
                    dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """:meth:`PagedKVCache.read_prefix` with block 0 from its float row where the cache
        keeps a sink (the pool holds its quantized copy: no kernel reads it)."""
        k, v = self.cache.read_prefix(layer, block_tables, num_tokens, dtype)  # [B, n, H, D]
        if self.num_sink:  # block 0 with a sink id (a partial one is staged) from its row
            ids, bs = block_tables[:, 0], self.block_size
            keep = (ids >= self.sink_from).view(-1, 1, 1, 1)  # else row 0, read and dropped
            s = self.buffer[:, layer, torch.where(keep.flatten(), ids + self.sink_shift, 0)].to(dtype)
            k[:, :bs], v[:, :bs] = torch.where(keep, s, torch.stack((k[:, :bs], v[:, :bs])))
        return k, v

    def overlay(self, layer: int, k: Tensor, v: Tensor, slots: Tensor,
                block_index: Tensor) -> None:
        """In gathered ``k, v [B, m * block_size, H, D]``, replace block ``block_index[b]``
        of row ``b`` by slot ``slots[b]``'s staged block."""
        rows = torch.arange(len(slots), device=k.device)
        for x, staged in zip((k, v), self.blocks(layer, slots, k.dtype)):
            x.unflatten(1, (-1, self.block_size))[rows, block_index] = staged

    def context(self, layer: int, block_table: Tensor, seq_len: int, query_len: int,
                slot: Tensor, staged: StagedKV | None,
                dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """One sequence's keys, values ``[1, n, H, D]`` (pool blocks of ``block_table [1, m]``,
        then its full-precision tokens) and mask ``[1, query_len, n]``. Without ``staged``
        (a decode), its own block comes from its staging ``slot [1]``."""
        bs = self.block_size
        if staged is None:
            start = (seq_len - 1) // bs * bs
            k_block, v_block = self.blocks(layer, slot, dtype)
            staged = StagedKV(start, k_block[0, :seq_len - start], v_block[0, :seq_len - start])
        k, v = self.read_prefix(layer, block_table, seq_len, dtype)
        mask = staged_mask(seq_len, query_len, k.shape[1], staged.start, len(staged.k), bs,
                           k.device)
        k, v = (torch.cat((x, s[None].to(dtype)), 1) for x, s in ((k, staged.k), (v, staged.v)))
        return k, v, mask[None]


def staged_mask(seq_len: int, query_len: int, num_pool_keys: int, staged_start: int,
                num_staged: int, block_size: int, device: torch.device) -> Tensor:
    """``[query_len, num_pool_keys + num_staged]`` bool for keys = pool keys, then staged
    keys: a query sees pool keys of earlier blocks and staged keys of its own block up to
    itself."""
    query_pos = torch.arange(seq_len - query_len, seq_len, device=device)[:, None]
    block_start = query_pos // block_size * block_size
    pool_pos = torch.arange(num_pool_keys, device=device)[None]
    staged_pos = staged_start + torch.arange(num_staged, device=device)[None]
    return torch.cat((pool_pos < block_start,
                      (staged_pos >= block_start) & (staged_pos <= query_pos)), 1)
