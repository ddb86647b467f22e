"""Per-sequence block tables on top of the block pool: prefix hits, growth, release."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Hashable

from slimkv.kv.block_pool import Block, BlockHash, BlockPool, hash_block
from slimkv.kv.connector import KVConnector
from slimkv.engine.sequence import Sequence
from slimkv.stats import cdiv


@dataclass(slots=True)
class _Session:
    head_tokens: int                  # the first turn's prompt: system prompt + document
    last_seen: float
    head_blocks: list[Block] = field(default_factory=list)


class KVCacheManager:
    """Allocates blocks as a sequence's tokens arrive and returns them when it ends.

    Only full blocks are hashed and shared. A sequence's blocks go back tail-first, so
    under ``lru_block`` the head of its context is the last of its blocks to be evicted;
    the head of a live session (``session_id`` given, seen within ``session_ttl_s``) is
    protected until every other free block is used.
    """

    def __init__(self, pool: BlockPool, block_size: int, *, session_ttl_s: float,
                 num_staging_slots: int = 0) -> None:
        self.pool = pool
        self._num_staging_slots = num_staging_slots
        self._free_staging = list(range(num_staging_slots - 1, -1, -1))
        self.block_size = block_size
        self.session_ttl_s = session_ttl_s
        self.sessions: dict[Hashable, _Session] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_offered: dict[str, int] = {}  # full blocks already offered to the index
        self.clock = time.monotonic  # a simulator sets its own (session ages)
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0     # of those, tokens found
        self.connector: KVConnector | None = None  # a KV store below the pool, set by the engine

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        """Longest run of cached full blocks at the start of the sequence's tokens, in the pool
        or loaded by the KV connector (a lookup: :meth:`allocate` counts it once admitted).

        At least one token is always left to compute, since its logits are needed."""
        hashes = self._block_hashes(seq, (seq.num_tokens - 1) // self.block_size)
        hits: list[Block] = []
        for block_hash in hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        hits += self.connector.load(hashes, hits) if self.connector else []  # e.g. host, disk
        return hits

    def max_blocks(self, num_tokens: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds at most."""
        return cdiv(num_tokens, self.block_size)

    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int,
                          computed: list[Block] = ()) -> int:
        total = seq.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        held = len(seq.blocks) + len(computed)
        return max(0, cdiv(total, self.block_size) - held)

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: list[Block] = ()) -> bool:
        free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        need = self.num_blocks_needed(seq, num_new_tokens, computed)
        return need + free_hits <= self.pool.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 computed: list[Block] | None = None) -> None:
        """Give ``seq`` room for ``num_new_tokens`` more tokens (check ``can_allocate`` first)
        and, on its first allocation, a staging slot. ``computed``: the prefix lookup of an
        admission (:meth:`get_computed_blocks`), counted in the prefix-cache counters."""
        self.assign_staging_slot(seq)
        if computed is not None:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += len(computed) * self.block_size
        if computed:
            self.pool.touch(computed)
            seq.blocks.extend(computed)
            seq.num_computed_tokens += len(computed) * self.block_size
            seq.num_cached_tokens = len(computed) * self.block_size
        need = self.num_blocks_needed(seq, num_new_tokens)
        if need:   # most decode steps need none: skip the pool (hot in the simulator)
            # Block 0 from the sink region, which holds a block per staging slot at least.
            seq.blocks.extend(self.pool.get_new_blocks(need, self.pool.num_sink > 0 and not seq.blocks))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Index the blocks whose tokens are all computed by their chained hash; each block
        is offered once per allocation (as vLLM's ``num_cached_block``), not every step."""
        num_full = seq.num_computed_tokens // self.block_size
        start = self._num_offered.get(seq.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(start, num_full):
            self.pool.cache_block(seq.blocks[i], hashes[i])
        self._num_offered[seq.request_id] = num_full

    def assign_staging_slot(self, seq: Sequence) -> None:
        """A staging slot (:mod:`slimkv.kv.staging`) from the first allocation until
        :meth:`free`, when the manager has slots (the cache is staged). A recompute after
        preemption starts at a block boundary, so a new slot's stale contents are never read."""
        if seq.staging_slot is not None or self._num_staging_slots == 0:
            return
        if not self._free_staging:
            raise RuntimeError("no free KV staging slot: more sequences are running than "
                               "kv_cache.max_concurrency_soft + 1")
        seq.staging_slot = self._free_staging.pop()

    def free(self, seq: Sequence) -> None:
        """Return a sequence's blocks tail-first, its staging slot, and forget it."""
        if seq.staging_slot is not None:
            self._free_staging.append(seq.staging_slot)
            seq.staging_slot = None
        if seq.session_id is not None:
            self._remember_session(seq)
        if self.connector:
            self.connector.save(self._hashes.get(seq.request_id, ()))
        self.pool.free_blocks(reversed(seq.blocks))
        seq.blocks = []
        self._hashes.pop(seq.request_id, None)
        self._num_offered.pop(seq.request_id, None)

    def expire_sessions(self, now: float | None = None) -> None:
        now = self.clock() if now is None else now
        for sid in [s for s, info in self.sessions.items()
                    if now - info.last_seen > self.session_ttl_s]:
            info = self.sessions.pop(sid)
            self.pool.set_session_head([b for b in info.head_blocks if b.session_head == sid], None)

    def _remember_session(self, seq: Sequence) -> None:
        info = self.sessions.setdefault(seq.session_id, _Session(seq.num_prompt_tokens, 0.0))
        info.last_seen = self.clock()
        num_full = min(info.head_tokens, seq.num_computed_tokens) // self.block_size
        info.head_blocks = [b for b in seq.blocks[:num_full] if b.block_hash is not None]
        self.pool.set_session_head(info.head_blocks, seq.session_id)

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Chained hashes of the first ``num_blocks`` full blocks, memoised per sequence."""
        hashes = self._hashes.setdefault(seq.request_id, [])
        while (i := len(hashes)) < num_blocks:
            tokens = seq.token_ids[i * self.block_size:(i + 1) * self.block_size]
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens))
        return hashes[:num_blocks]
