"""A step's inputs on the device: block tables kept there and updated with new block ids
only, and the step's integers sent in one copy.

:class:`BlockTables` gives each sequence a row of one device table ``[rows, width]`` and
writes only the ids its sequence gained since the last step: a sequence's blocks only grow
at the end between steps (the KV manager extends ``seq.blocks``); a free or preemption
replaces the list, which is noticed by identity, and the row is written again. No step
walks whole block tables in Python.

:func:`build_step` lays the step's token ids, positions, pool slots, per-sequence lengths,
table rows, staging slots, decode plan and table updates out in one int64 host buffer
(pinned on CUDA) and sends it with one non-blocking copy; the step's block tables are then
gathered on the device from its rows. (Positions and slots were computed on the device
from the rows first: a few tiny torch ops per step, which cost more on a CPU, where
OpenMP wakes its threads for each, than the new tokens' Python loop.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from slimkv.attention.metadata import AttentionMetadata, decode_index
from slimkv.engine.sequence import Sequence


class _Row:
    __slots__ = ("index", "blocks", "known")

    def __init__(self, index: int) -> None:
        self.index, self.blocks, self.known = index, None, 0


class BlockTables:
    """Each sequence's block ids in a row of ``table [rows, width]`` (int64, on ``device``);
    rows past a sequence's blocks hold stale ids, never read (every kernel stops at the
    sequence's length) but valid block ids all the same."""

    def __init__(self, width: int, device: torch.device, rows: int = 8) -> None:
        self.device = device
        self.table = torch.zeros(rows, width, dtype=torch.long, device=device)
        self._rows: dict[Sequence, _Row] = {}
        self._free = list(range(rows - 1, -1, -1))

    def update(self, seqs: list[Sequence]) -> tuple[list[int], list[int], list[int], list[int]]:
        """The rows of ``seqs``, and the ``(rows, columns, ids)`` of the table entries to write
        for this step (:meth:`apply`): the ids each sequence gained since its last step, or
        its whole table where its row is new or its block list was replaced."""
        rows, at, cols, ids = [], [], [], []
        need = max(len(s.blocks) for s in seqs)
        if need > self.table.shape[1]:
            self._grow(self.table.shape[0], need)
        for seq in seqs:
            row = self._rows.get(seq) or self._assign(seq, seqs)
            blocks = seq.blocks
            if row.blocks is not blocks or row.known > len(blocks):
                row.blocks, row.known = blocks, 0
                self.table[row.index].zero_()  # as a fresh table's padding (rare: admission)
            new = blocks[row.known:]
            if new:
                at += [row.index] * len(new)
                cols += range(row.known, len(blocks))
                ids += [b.block_id for b in new]
                row.known = len(blocks)
            rows.append(row.index)
        return rows, at, cols, ids

    def apply(self, at: Tensor, cols: Tensor, ids: Tensor) -> None:
        if len(ids):
            self.table[at, cols] = ids

    def _assign(self, seq: Sequence, step: list[Sequence]) -> _Row:
        if not self._free:  # forget the sequences outside this step, then grow if need be
            current = set(map(id, step))
            for other in [s for s in self._rows if id(s) not in current]:
                self._free.append(self._rows.pop(other).index)
        if not self._free:
            rows = self.table.shape[0]
            self._grow(2 * rows, self.table.shape[1])
            self._free = list(range(2 * rows - 1, rows - 1, -1))
        row = self._rows[seq] = _Row(self._free.pop())
        return row

    def _grow(self, rows: int, width: int) -> None:
        table = torch.zeros(rows, width, dtype=torch.long, device=self.device)
        old = self.table
        table[:old.shape[0], :old.shape[1]] = old
        self.table = table


class StepInputs(NamedTuple):
    ids: Tensor          # [T] token ids
    positions: Tensor    # [T]
    meta: AttentionMetadata


def _send(values: list[int], device: torch.device) -> Tensor:
    """One int64 host tensor on ``device``: pinned and copied without blocking on CUDA."""
    host = torch.tensor(values, dtype=torch.long)
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def build_step(tables: BlockTables, scheduled: list[tuple[Sequence, int]], block_size: int,
               staged: bool, piece_dtype: torch.dtype | None) -> StepInputs:
    """The step's input ids, positions and attention metadata for ``(sequence, new tokens)``
    pairs; ``staged``: the cache has staging slots."""
    seqs = [seq for seq, _ in scheduled]
    query_lens = [n for _, n in scheduled]
    starts = [seq.num_computed_tokens for seq in seqs]
    seq_lens = [s + n for s, n in zip(starts, query_lens)]
    query_start_loc = [0]
    for n in query_lens:
        query_start_loc.append(query_start_loc[-1] + n)
    ids = [t for seq, s, e in zip(seqs, starts, seq_lens) for t in seq.token_ids[s:e]]
    # Positions and pool slots of the new tokens only: a token's block is among the last
    # few of its sequence (no walk over whole tables).
    positions = [p for s, e in zip(starts, seq_lens) for p in range(s, e)]
    slot_mapping = [seq.blocks[p // block_size].block_id * block_size + p % block_size
                    for seq, s, e in zip(seqs, starts, seq_lens) for p in range(s, e)]
    rows, at, cols, new_ids = tables.update(seqs)
    slots = [seq.staging_slot for seq in seqs] if staged else []
    decodes = decode_index(query_start_loc, query_lens, seq_lens, block_size)
    filled = [j for j, n in enumerate(n for n, q in zip(seq_lens, query_lens) if q == 1)
              if n % block_size == 0]
    parts = [ids, positions, slot_mapping, seq_lens, rows, slots,
             [x for row in decodes for x in row], filled, at, cols, new_ids]
    sent = _send([x for part in parts for x in part], tables.device)
    (ids_t, positions_t, slots_t, lens_t, rows_t, staging_t, decodes_t, filled_t, at_t, cols_t,
     new_t) = sent.split([len(p) for p in parts])
    tables.apply(at_t, cols_t, new_t)
    width = max(len(seq.blocks) for seq in seqs)
    meta = AttentionMetadata(
        slots_t, query_start_loc, query_lens, seq_lens,
        tables.table[:, :width].index_select(0, rows_t), lens_t, block_size,
        staging_t if staged else None, slots if staged else None, piece_dtype,
        decodes_t.view(3, -1) if decodes[0] else None, filled_t if filled else None)
    return StepInputs(ids_t, positions_t, meta)
