"""What one step's attention needs, built once per step before the forward pass and read
(never written) by every layer: where the new tokens go, what each sequence attends to, the
decode plan and each prefill chunk's plan. Everything here depends on positions only, so it
is the same in every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from slimkv.attention.prefill import Piece, plan


@dataclass(slots=True, frozen=True)
class PrefillChunk:
    """Sequence ``seq``'s chunk: query rows ``rows``, positions ``[start, seq_len)``.
    ``staged_start``: for a staged cache, the first position of the block holding ``start``
    (the chunk sees its own blocks at full precision from there); ``pieces``: its SDPA
    pieces (:func:`slimkv.attention.prefill.plan`) where the step was built for a backend
    that attends in pieces, else None."""

    seq: int
    rows: slice
    start: int
    seq_len: int
    staged_start: int | None
    pieces: tuple[Piece, ...] | None


@dataclass(slots=True, frozen=True)
class AttentionMetadata:
    """The step's tokens are laid out sequence after sequence: sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; they are the *last* ``query_lens[i]`` tokens
    of its ``seq_lens[i]``-token context, whose KV lives in the blocks ``block_tables[i]``.
    ``piece_dtype``: plan the prefill chunks' SDPA pieces with masks in that dtype.
    """

    slot_mapping: Tensor            # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: list[int]      # [B + 1] cumulative query lengths
    query_lens: list[int]           # [B] new tokens per sequence this step
    seq_lens: list[int]             # [B] context length per sequence after this step
    block_tables: Tensor            # [B, max_blocks] int64, padded past each table's end
    seq_lens_t: Tensor              # [B] int64, seq_lens on the device
    block_size: int
    staging_slots: Tensor | None = None  # [B] int64: staging slot per sequence (staged cache)
    staging_slot_ids: list[int] | None = None  # the same on the host
    piece_dtype: torch.dtype | None = None
    # [3, n] int64 on the device: the decodes' query rows, last block indices, offsets in
    # them (:func:`decode_index`; sent with the step's other inputs; None: made here)
    decode_index: Tensor | None = None
    decode_filled: Tensor | None = None  # with decode_index: which decodes fill their block
    decode: DecodePlan | None = field(init=False)  # the single-token queries
    prefills: tuple[PrefillChunk, ...] = field(init=False)  # the chunks of > 1 token

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: filled once, here
        set_(self, "decode", DecodePlan.build(self))
        set_(self, "prefills", tuple(self._chunk(i) for i, n in enumerate(self.query_lens)
                                     if n > 1))

    def _chunk(self, i: int) -> PrefillChunk:
        seq_len, n, bs = self.seq_lens[i], self.query_lens[i], self.block_size
        start = seq_len - n
        staged = None if self.staging_slot_ids is None else start // bs * bs
        pieces = None if self.piece_dtype is None else tuple(
            plan(seq_len, n, staged, bs, self.piece_dtype, self.block_tables.device))
        rows = slice(self.query_start_loc[i], self.query_start_loc[i] + n)
        return PrefillChunk(i, rows, start, seq_len, staged, pieces)

    @classmethod
    def build(cls, block_size: int, tables: list[list[int]], query_lens: list[int],
              seq_lens: list[int], device: torch.device,
              staging_slots: list[int] | None = None,
              piece_dtype: torch.dtype | None = None) -> AttentionMetadata:
        """From each sequence's block ids, new-token count and context length (tests and the
        start-up replay; the engine's steps come from :mod:`slimkv.engine.step_inputs`)."""
        slots = [table[p // block_size] * block_size + p % block_size
                 for table, q, s in zip(tables, query_lens, seq_lens) for p in range(s - q, s)]
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        width = max(len(t) for t in tables)

        def tensor(values: list) -> Tensor:
            return torch.tensor(values, dtype=torch.long, device=device)

        return cls(tensor(slots), starts, list(query_lens), list(seq_lens),
                   tensor([t + [0] * (width - len(t)) for t in tables]), tensor(seq_lens),
                   block_size, None if staging_slots is None else tensor(staging_slots),
                   None if staging_slots is None else list(staging_slots), piece_dtype)


def decode_index(query_start_loc: list[int], query_lens: list[int], seq_lens: list[int],
                 block_size: int) -> list[list[int]]:
    """Three rows over the decodes (query length 1): their query rows, the index in each
    table of the block holding the new token, and the token's offset there."""
    decodes = [(query_start_loc[i], s - 1) for i, (n, s) in enumerate(zip(query_lens, seq_lens))
               if n == 1]
    return [[row for row, _ in decodes], [p // block_size for _, p in decodes],
            [p % block_size for _, p in decodes]]


@dataclass(slots=True, frozen=True)
class DecodePlan:
    """A step's single-token queries, gathered once per step for all layers."""

    seqs: list[int]                 # their sequence indices in the batch
    rows: Tensor                    # [n] their query rows
    block_tables: Tensor            # [n, m]
    seq_lens: Tensor                # [n]
    max_len: int
    staging_slots: Tensor | None    # [n]
    last_block: Tensor              # [n] index in the table of the block holding the new token
    last_block_id: Tensor           # [n] that block's id
    filled: Tensor | None           # which of the n tokens fill their block (None: none do)
    offsets: Tensor                 # [n] the new token's offset in its block
    whole: bool                     # the step is decodes only (rows == 0..n-1)

    @classmethod
    def build(cls, meta: AttentionMetadata) -> DecodePlan | None:
        seqs = [i for i, n in enumerate(meta.query_lens) if n == 1]
        if not seqs:
            return None
        device, whole = meta.block_tables.device, len(seqs) == len(meta.query_lens)
        tables, seq_lens, slots = meta.block_tables, meta.seq_lens_t, meta.staging_slots
        if not whole:  # (indexing copies: contiguous)
            index = torch.tensor(seqs, device=device)
            tables, seq_lens = tables[index], seq_lens[index]
            slots = None if slots is None else slots[index]
        lens, bs = [meta.seq_lens[i] for i in seqs], meta.block_size
        # Rows, last block index and offset from the host's lengths, sent with the step's
        # other inputs where the engine built it (no device sync in any layer).
        index, filled = meta.decode_index, meta.decode_filled
        if index is None:
            index = torch.tensor(decode_index(meta.query_start_loc, meta.query_lens,
                                              meta.seq_lens, bs), device=device)
            filled = [j for j, n in enumerate(lens) if n % bs == 0]
            filled = torch.tensor(filled, device=device) if filled else None
        rows, last, offsets = index  # rows of a [3, n] tensor: each contiguous
        return cls(seqs, rows, tables, seq_lens, max(lens), slots, last,
                   tables.gather(1, last[:, None]).squeeze(1), filled, offsets, whole)
