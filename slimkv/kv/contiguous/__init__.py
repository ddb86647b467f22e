"""The contiguous baseline (``kv_cache.paged: false``), kept to show what paging fixes.

Like engines without paging, each request reserves one contiguous run of blocks for
``max_model_len`` tokens when it is admitted, whatever it will really use. A request
that waits although the blocks its tokens and the running requests' tokens really need
would fit in the pool is a *false OOM*: the memory exists but the reservations hold it
(the case's "several a day").

It has the paged manager's interface and composes one (:mod:`slimkv.kv.manager`) for what
the two share: staging slots, sessions, freeing tail-first. Prefix caching is off. A
plug-in, not serving: :func:`slimkv.plugins.build_engine` hands it to the engine, and the
simulator drives it; the core never imports it.
"""

from __future__ import annotations

from slimkv.kv.block_pool import Block, BlockPool
from slimkv.kv.manager import KVCacheManager
from slimkv.engine.sequence import Sequence
from slimkv.stats import cdiv


class ContiguousKVManager:
    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int, *,
                 session_ttl_s: float, num_staging_slots: int = 0) -> None:
        self.paged = KVCacheManager(pool, block_size, session_ttl_s=session_ttl_s,
                                    num_staging_slots=num_staging_slots)
        self.pool = pool
        self.block_size = block_size
        self.reserve_blocks = cdiv(max_model_len, block_size)
        self.false_oom_requests: set[str] = set()
        self._live: dict[str, Sequence] = {}
        self.num_prefix_queries = self.num_prefix_hits = 0   # no prefix cache

    @property
    def num_false_oom(self) -> int:
        return len(self.false_oom_requests)

    def max_blocks(self, num_tokens: int) -> int:
        """Every request holds its whole reservation."""
        return self.reserve_blocks

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        return []

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: list[Block] = ()) -> bool:
        if seq.blocks or self._find_run() is not None:
            return True
        really_used = sum(cdiv(s.num_tokens, self.block_size) for s in self._live.values())
        if really_used + cdiv(seq.max_total_tokens(), self.block_size) <= self.pool.num_blocks:
            self.false_oom_requests.add(seq.request_id)
        return False

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 computed: list[Block] | None = None) -> None:
        self.paged.assign_staging_slot(seq)
        if not seq.blocks:
            start = self._find_run()
            run = self.pool.blocks[start:start + self.reserve_blocks]
            self.pool.touch(run)
            seq.blocks = run
            self._live[seq.request_id] = seq

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Nothing to index: the pool of a contiguous cache does no prefix caching."""

    def free(self, seq: Sequence) -> None:
        self._live.pop(seq.request_id, None)
        self.paged.free(seq)

    def expire_sessions(self, now: float | None = None) -> None:
        self.paged.expire_sessions(now)

    def _find_run(self) -> int | None:
        """First block id starting ``reserve_blocks`` consecutive free blocks."""
        length = 0
        for block in self.pool.blocks:
            length = length + 1 if block.ref_cnt == 0 else 0
            if length == self.reserve_blocks:
                return block.block_id - length + 1
        return None
