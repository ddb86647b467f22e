"""What one step's attention needs, built once per step (by the model runner) and passed to
every layer: where the new tokens go, what each sequence attends to, the decode plan, and
(for a staged cache) each prefill's full-precision K/V of the layer being run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from slimkv.kv.staging import StagedKV
from slimkv.attention.prefill import Piece


@dataclass(slots=True)
class AttentionMetadata:
    """The step's tokens are laid out sequence after sequence: sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; they are the *last* ``query_lens[i]`` tokens
    of its ``seq_lens[i]``-token context, whose KV lives in the blocks ``block_tables[i]``.
    """

    slot_mapping: Tensor            # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: list[int]      # [B + 1] cumulative query lengths
    query_lens: list[int]           # [B] new tokens per sequence this step
    seq_lens: list[int]             # [B] context length per sequence after this step
    block_tables: Tensor            # [B, max_blocks] int64, padded with 0 past each table's end
    seq_lens_t: Tensor              # [B] int64, seq_lens on the device
    block_size: int
    staging_slots: Tensor | None = None  # [B] int64: staging slot per sequence (staged cache)
    staging_slot_ids: list[int] | None = None  # the same on the host
    decode: DecodePlan | None = field(init=False)  # the single-token queries, for every layer
    # Per prefill (by sequence index), its K/V at full precision from the start of its first
    # block; written by each layer's cache write for that layer's attention (staged cache).
    staged: dict[int, StagedKV] = field(init=False, default_factory=dict)
    # Per prefill, its attention pieces, planned by the step's first layer for all of them.
    prefill_pieces: dict[int, list[Piece]] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.decode = DecodePlan.build(self)

    @classmethod
    def build(cls, block_size: int, tables: list[list[int]], query_lens: list[int],
              seq_lens: list[int], device: torch.device,
              staging_slots: list[int] | None = None) -> AttentionMetadata:
        """From each sequence's block ids, new-token count and context length."""
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
                   None if staging_slots is None else list(staging_slots))


@dataclass(slots=True)
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
        # Rows, last block index and offset from the host's lengths, in one copy (and no
        # device sync in any layer).
        rows, last, offsets = torch.tensor([[meta.query_start_loc[i] for i in seqs],
                                            [(n - 1) // bs for n in lens],
                                            [(n - 1) % bs for n in lens]], device=device)
        filled = [j for j, n in enumerate(lens) if n % bs == 0]
        return cls(seqs, rows, tables, seq_lens, max(lens), slots, last,
                   tables.gather(1, last[:, None]).squeeze(1),
                   torch.tensor(filled, device=device) if filled else None, offsets, whole)
