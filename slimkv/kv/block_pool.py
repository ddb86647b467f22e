"""Block bookkeeping for the paged KV pool, in plain Python.

The pool never touches tensors: it hands out block ids, counts references and keeps
prefix-cached blocks findable by their chained hash. Free blocks sit in doubly-linked
queues threaded through the ``Block`` objects, so taking a cached block back out of the
free queue on a prefix hit is O(1) (as in vLLM v1). Eviction is lazy: a free block keeps
its hash, and so stays reusable, until it is handed out again.

Two free queues give the case's eviction rule (MISSION item 6): blocks at the head of a
live multi-turn session go to ``protected`` and are evicted only once every other free
block is gone.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Hashable

BlockHash = bytes  # 16-byte chained digest: the same in every process, run and replica


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """Key of a full block: blake2b-128 of the previous block's key and this block's token
    ids (little-endian uint32), so a key names the whole prefix. Stable across processes
    (never Python's ``hash``): replicas route by it and the offload tier files by it."""
    data = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.blake2b(data, digest_size=16, key=parent or b"").digest()


class Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "alloc_seq", "session_head",
                 "last_used", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.alloc_seq = 0  # when the block was last handed out empty (fifo order)
        self.session_head: Hashable | None = None  # session whose head this block holds
        self.last_used = 0  # logical clock of the last allocation, hit or free
        self.prev_free: Block | None = None
        self.next_free: Block | None = None

    @property
    def state(self) -> str:
        """``in_use`` while a sequence holds it; a free block is a ``pinned`` session head,
        ``cached`` (prefix-indexed, evicted when handed out again) or ``free``."""
        if self.ref_cnt > 0:
            return "in_use"
        if self.session_head is not None:
            return "pinned"
        return "cached" if self.block_hash is not None else "free"

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks; the head is evicted first."""

    def __init__(self, blocks: Iterable[Block] = ()) -> None:
        self._head, self._tail = Block(-1), Block(-1)  # sentinels
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_blocks -= 1

    def append(self, block: Block) -> None:
        self._insert_after(self._tail.prev_free, block)

    def insert_by_alloc_seq(self, block: Block) -> None:
        """Keep the queue ordered by first allocation (the ``fifo`` policy)."""
        after = self._tail.prev_free
        while after is not self._head and after.alloc_seq > block.alloc_seq:
            after = after.prev_free
        self._insert_after(after, block)

    def _insert_after(self, after: Block, block: Block) -> None:
        block.prev_free, block.next_free = after, after.next_free
        after.next_free.prev_free = block
        after.next_free = block
        self.num_blocks += 1

    def __iter__(self) -> Iterator[Block]:
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free

    def __len__(self) -> int:
        return self.num_blocks


class BlockPool:
    """All blocks of the pool with ref counts, a prefix-cache index and free queues."""

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 evict_policy: str = "lru_block", num_sink: int = 0) -> None:
        # The last num_sink of the num_blocks ids are the float sink region (docs/kv-formats.md):
        # their own free queue serves every sequence's block 0, the rest all other blocks.
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.num_sink, self.sink_from = num_sink, num_blocks - num_sink
        self.free_queue = FreeBlockQueue(self.blocks[:self.sink_from])
        self.sink_queue = FreeBlockQueue(self.blocks[self.sink_from:])
        self.protected = FreeBlockQueue()
        self.cached: dict[BlockHash, Block] = {}
        self.enable_caching = enable_caching
        self.evict_policy = evict_policy
        self.num_evictions = 0
        self._clock = 0
        self.on_evict: Callable[[Block], None] = lambda block: None  # a KV connector's write-back
        # Copies pool block src's (quantized) content to dst, all layers: see _demote
        self.on_demote: Callable[[int, int], None] | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks outside the sink region (what admission and usage count)."""
        return self.sink_from

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_blocks + self.protected.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (free cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def get_new_blocks(self, n: int, sink: bool = False) -> list[Block]:
        """Hand out ``n`` empty blocks, evicting the cached content of reused ones; with
        ``sink``, the first from the sink region if it has one free (else it is quantized like
        the rest: every reader decides per block id)."""
        sink = sink and len(self.sink_queue) > 0
        if n - sink > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks, {self.num_free_blocks} free")
        out = []
        for i in range(n):
            queue = (self.sink_queue if sink and not i else
                     self.free_queue if len(self.free_queue) else self.protected)
            block = queue.popleft()
            if queue is self.sink_queue and block.block_hash and self.on_demote \
                    and len(self.free_queue) >= n:
                self._demote(block)
            self._evict(block)
            block.ref_cnt = 1
            block.alloc_seq = block.last_used = self.tick()
            out.append(block)
        return out

    def get_cached_block(self, block_hash: BlockHash) -> Block | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: Iterable[Block]) -> None:
        """Take a reference on prefix-hit blocks, pulling free ones out of their queue."""
        now = self.tick()
        for block in blocks:
            if block.ref_cnt == 0:
                self._queue(block).remove(block)
            block.ref_cnt += 1
            block.last_used = now

    def cache_block(self, block: Block, block_hash: BlockHash) -> None:
        """Index a full block by its chained hash (first writer wins on duplicates)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block; blocks reaching zero join a free queue in
        the order given (callers pass a sequence's blocks tail-first)."""
        now = self.tick()
        for block in blocks:
            block.ref_cnt -= 1
            block.last_used = now
            if block.ref_cnt > 0:
                continue
            queue = self._queue(block)
            if queue is self.free_queue and self.evict_policy == "fifo":
                queue.insert_by_alloc_seq(block)
            else:
                queue.append(block)

    def set_session_head(self, blocks: Iterable[Block], session: Hashable | None) -> None:
        """Mark (or with ``None`` unmark) blocks as the head of a live session."""
        if self.evict_policy != "lru_block":
            return
        for block in blocks:
            if block.session_head == session:
                continue
            if block.ref_cnt == 0:
                self._queue(block).remove(block)
                block.session_head = session
                self._queue(block).append(block)
            else:
                block.session_head = session

    def _queue(self, block: Block) -> FreeBlockQueue:
        """The free queue a block joins at ref count 0 (sink blocks: the sink's, always)."""
        return (self.sink_queue if block.block_id >= self.sink_from else
                self.protected if block.session_head is not None else self.free_queue)

    def _demote(self, sink: Block) -> None:
        """A cached sink block handed out again leaves its hash to a regular block holding its
        quantized copy (the pool's, which no sequence reads while the sink is cached): under
        a chained hash, losing block 0 would lose every block of the prefix behind it."""
        block = self.free_queue.popleft()
        self._evict(block)
        self.on_demote(sink.block_id, block.block_id)
        block.block_hash, block.last_used = sink.block_hash, sink.last_used
        self.cached[sink.block_hash], sink.block_hash = block, None
        self.free_queue.append(block)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            self.on_evict(block)  # still holding its hash and data
            del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
        block.session_head = None
