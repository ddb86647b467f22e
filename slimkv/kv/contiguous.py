"""The contiguous baseline (``kv_cache.paged: false``), kept to show what paging fixes.

Like engines without paging, each request reserves one contiguous run of blocks for
``max_model_len`` tokens when it is admitted, whatever it will really use. A request
that waits although the blocks its tokens and the running requests' tokens really need
would fit in the pool is a *false OOM*: the memory exists but the reservations hold it
(the case's "several a day").
"""

from __future__ import annotations

from slimkv.kv.block_pool import Block, BlockPool
from slimkv.kv.manager import KVCacheManager
from slimkv.sequence import Sequence


class ContiguousKVManager(KVCacheManager):
    def __init__(self, pool: BlockPool, block_size: int, max_model_len: int,
                 num_staging_slots: int = 0) -> None:
        super().__init__(pool, block_size, num_staging_slots=num_staging_slots)
        self.reserve_blocks = -(-max_model_len // block_size)
        self.false_oom_requests: set[str] = set()
        self._live: dict[str, Sequence] = {}

    @property
    def num_false_oom(self) -> int:
        return len(self.false_oom_requests)

    def blocks_for(self, num_tokens: int) -> int:
        return self.reserve_blocks

    def get_computed_blocks(self, seq: Sequence) -> list[Block]:
        return []

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed: list[Block] = ()) -> bool:
        if seq.blocks:
            return True
        if self._find_run() is not None:
            return True
        really_used = sum(super(ContiguousKVManager, self).blocks_for(s.num_tokens)
                          for s in self._live.values())
        if really_used + super().blocks_for(seq.max_total_tokens()) <= self.pool.num_blocks:
            self.false_oom_requests.add(seq.request_id)
        return False

    def allocate(self, seq: Sequence, num_new_tokens: int, computed: list[Block] = ()) -> None:
        self._assign_staging_slot(seq)
        if not seq.blocks:
            start = self._find_run()
            run = self.pool.blocks[start:start + self.reserve_blocks]
            self.pool.touch(run)
            seq.blocks = run
            self._live[seq.request_id] = seq

    def free(self, seq: Sequence) -> None:
        self._live.pop(seq.request_id, None)
        super().free(seq)

    def _find_run(self) -> int | None:
        """First block id starting ``reserve_blocks`` consecutive free blocks."""
        length = 0
        for block in self.pool.blocks:
            length = length + 1 if block.ref_cnt == 0 else 0
            if length == self.reserve_blocks:
                return block.block_id - length + 1
        return None
