"""The offload tier: the pool's chunks kept in host memory and on disk, loaded back
instead of recomputed.

**Writes.** When a sequence frees its blocks, the KV manager hands its block hashes here;
each chunk (``CHUNK_BLOCKS`` blocks, the last one possibly partial) not stored yet becomes
*pending*. A pending chunk
is copied out of the pool (a gather, on the engine thread, while its blocks still hold it)
when the pool evicts any of its blocks (``write: evict``), or once it has been idle for
``idle_s`` (``write: idle``; checked whenever a sequence is freed), or at once when the
sequence frees its blocks (``write: through``), or on :meth:`close` (also at process exit).
The copy goes to a background writer through a bounded queue (full: the chunk is dropped
and counted), which stores it in the host tier; chunks the host tier pushes out spill to
disk. Under ``write: through`` every chunk also goes straight to disk, where every process
sharing the directory finds it (a replica's death loses none of its finished turns).

**Reads.** After the pool's prefix match, admission (:meth:`load`) walks on along the
chain one chunk at a time (the full chunk, else the longest partial one): a chunk still
queued, then host, then disk. A found chunk's blocks go into new pool blocks, indexed by their hashes like any prefix-cached block, so
the sequence counts them as cache hits. The first miss ends the walk (recompute).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence

from torch import Tensor

from slimkv.kv.block_pool import Block, BlockHash, BlockPool
from slimkv.kv.offload.chunk import CHUNK_BLOCKS, ChunkLayout
from slimkv.kv.offload.config import OffloadConfig
from slimkv.kv.offload.disk import DiskTier
from slimkv.kv.offload.host import HostTier
from slimkv.kv.offload.stats import LOAD_BUCKETS, TierStats

log = logging.getLogger(__name__)
GiB = 1 << 30
TIERS = ("host", "disk")


class _Counts:
    def __init__(self) -> None:
        self.stored = self.loaded = self.dropped = 0
        self.load_counts = [0] * (len(LOAD_BUCKETS) + 1)
        self.load_seconds = 0.0

    def record_load(self, seconds: float, num_blocks: int) -> None:
        self.loaded += num_blocks
        self.load_seconds += seconds
        self.load_counts[sum(seconds > bound for bound in LOAD_BUCKETS)] += 1


class OffloadTier:
    def __init__(self, layout: ChunkLayout, config: OffloadConfig, pin: bool = False) -> None:
        self.layout = layout
        self.config = config
        self.host = (HostTier(int(config.host_gb * GiB), layout.num_bytes, pin)
                     if config.host_gb > 0 else None)
        self.disk = (DiskTier(config.disk_path, int(config.disk_gb * GiB),
                              layout.format_digest, layout.num_bytes)
                     if config.disk_path is not None else None)
        self.pool: BlockPool | None = None
        self.counts = {tier: _Counts() for tier in TIERS}
        self._pending: OrderedDict[bytes, tuple[tuple[BlockHash, ...], float]] = OrderedDict()
        self._chunk_of: dict[BlockHash, bytes] = {}
        self._inflight: dict[bytes, Tensor] = {}
        self._lock = threading.Lock()
        self._queue: queue.Queue[tuple[bytes, Tensor] | None] = queue.Queue(config.queue_chunks)
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload", daemon=True)
        self._writer.start()

    def attach(self, pool: BlockPool) -> None:
        """Serve ``pool``: its evictions write back here."""
        self.pool = pool
        pool.on_evict = self.on_evict

    @property
    def first_tier(self) -> str:
        return "host" if self.host is not None else "disk"

    def contains(self, key: bytes) -> bool:
        return (key in self._inflight or (self.host is not None and key in self.host)
                or (self.disk is not None and key in self.disk))

    # -- writes (engine thread) ------------------------------------------------------------

    def save(self, hashes: Sequence[BlockHash], now: float | None = None) -> None:
        """A sequence freed blocks with these chained hashes: its chunks not stored yet
        become pending (newest last). Also when idle chunks are written (``write: idle``)."""
        now = time.monotonic() if now is None else now
        self.tick(now)
        ends = list(range(CHUNK_BLOCKS, len(hashes) + 1, CHUNK_BLOCKS))
        if len(hashes) % CHUNK_BLOCKS:
            ends.append(len(hashes))        # the partial tail chunk
        for end in ends:
            chunk = tuple(hashes[(end - 1) // CHUNK_BLOCKS * CHUNK_BLOCKS:end])
            key = self.layout.key(chunk[-1])
            if key in self._pending:
                self._pending[key] = (chunk, now)
                self._pending.move_to_end(key)
            elif not self.contains(key) and self._blocks_of(chunk) is not None:
                self._pending[key] = (chunk, now)
                self._chunk_of.update(dict.fromkeys(chunk, key))
                if self.config.write == "through":
                    self._write_pending(key)

    def on_evict(self, block: Block) -> None:
        """The pool is about to reuse ``block`` (its content still intact): write back the
        pending chunk it belongs to."""
        key = self._chunk_of.get(block.block_hash)
        if key is not None:
            self._write_pending(key)

    def tick(self, now: float | None = None) -> None:
        """``write: idle``: write the chunks pending for ``idle_s`` or more."""
        if self.config.write != "idle":
            return
        now = time.monotonic() if now is None else now
        while self._pending:
            key, (_, since) = next(iter(self._pending.items()))
            if now - since < self.config.idle_s:
                break
            self._write_pending(key)

    def _write_pending(self, key: bytes, wait: bool = False) -> None:
        chunk, _ = self._pending.pop(key)
        for block_hash in chunk:
            self._chunk_of.pop(block_hash, None)
        blocks = self._blocks_of(chunk)
        if blocks is None:
            return
        payload = self.layout.gather([b.block_id for b in blocks])
        try:
            with self._lock:
                self._inflight[key] = payload
            self._queue.put((key, payload), block=wait)
        except queue.Full:
            with self._lock:
                self._inflight.pop(key, None)
            self.counts[self.first_tier].dropped += CHUNK_BLOCKS

    def _blocks_of(self, chunk: Sequence[BlockHash]) -> list[Block] | None:
        """The pool blocks holding a chunk, or None when any of them is gone."""
        blocks = [self.pool.cached.get(h) for h in chunk]
        return None if any(b is None for b in blocks) else blocks

    # -- writes (writer thread) ------------------------------------------------------------

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._store(*item)
            except Exception:  # never let one chunk kill the writer
                log.exception("offload: storing a chunk failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._inflight.pop(item[0], None)
                self._queue.task_done()

    def _store(self, key: bytes, payload: Tensor) -> None:
        if self.host is not None and self.host.num_slots:
            spilled = self.host.put(key, payload)
            self.counts["host"].stored += CHUNK_BLOCKS
        else:
            spilled = [(key, payload)]
        if self.config.write == "through" and self.disk is not None:
            spilled = [(key, payload)]   # what host pushes out went to disk on arrival
        for spilled_key, spilled_payload in spilled:
            if self.disk is None:
                self.counts["host"].dropped += CHUNK_BLOCKS
                continue
            stored, evicted = self.disk.put(spilled_key, spilled_payload)
            disk = self.counts["disk"]
            disk.stored += CHUNK_BLOCKS if stored else 0
            disk.dropped += CHUNK_BLOCKS * (evicted + (not stored))

    # -- reads -----------------------------------------------------------------------------

    def fetch(self, key: bytes) -> tuple[Tensor, str] | None:
        """A chunk's payload and the tier it came from (a queued chunk counts as its first
        tier's)."""
        with self._lock:
            payload = self._inflight.get(key)
        if payload is not None:
            return payload, self.first_tier
        if self.host is not None and (payload := self.host.get(key)) is not None:
            return payload, "host"
        if self.disk is not None and (payload := self.disk.get(key)) is not None:
            return payload, "disk"
        return None

    def _find(self, hashes: Sequence[BlockHash], pos: int) -> tuple[Tensor, str, int] | None:
        """The longest stored chunk covering block ``pos`` of the chain (full first, then
        partial ones): its payload, tier and end (the index after its last block)."""
        begin = pos // CHUNK_BLOCKS * CHUNK_BLOCKS
        for end in range(min(len(hashes), begin + CHUNK_BLOCKS), pos, -1):
            found = self.fetch(self.layout.key(hashes[end - 1]))
            if found is not None:
                return found[0], found[1], end
        return None

    def load(self, hashes: Sequence[BlockHash], hits: list[Block]) -> list[Block]:
        """Blocks loaded into the pool for the chain ``hashes`` past its pool ``hits``, one
        chunk at a time, as prefix-cached blocks (reference count 0, like free hits)."""
        pool, loaded, held = self.pool, [], False
        try:
            while True:
                start_time, pos = time.perf_counter(), len(hits) + len(loaded)
                found = self._find(hashes, pos)
                if found is None:
                    break
                payload, tier, end = found
                if not held:
                    pool.touch(hits)   # hold the hits while new blocks are handed out
                    held = True
                if pool.num_free_blocks < end - pos:
                    break
                blocks = pool.get_new_blocks(end - pos)
                self.layout.scatter(payload, [b.block_id for b in blocks], pos % CHUNK_BLOCKS)
                for block, block_hash in zip(blocks, hashes[pos:end]):
                    pool.cache_block(block, block_hash)
                loaded += blocks
                self.counts[tier].record_load(time.perf_counter() - start_time, len(blocks))
                if end % CHUNK_BLOCKS:
                    break      # a partial chunk ends what was stored of the chain
        finally:
            if held:
                pool.free_blocks(reversed(hits + loaded))
        return loaded

    # -- lifecycle and stats ---------------------------------------------------------------

    def flush(self) -> None:
        """Wait until every queued chunk is stored."""
        self._queue.join()

    def close(self) -> None:
        """Write every pending chunk (the pool's content dies with the process), wait for
        the writer and stop it."""
        if not self._writer.is_alive():
            return
        for key in list(self._pending):
            self._write_pending(key, wait=True)
        self._queue.put(None)
        self._writer.join()
        if self.host is not None and self.disk is not None:
            for key in self.host.keys():   # host memory dies with the process too
                if key in self.disk:
                    continue
                payload = self.host.get(key)
                if payload is not None and self.disk.put(key, payload)[0]:
                    self.counts["disk"].stored += CHUNK_BLOCKS

    def stats(self) -> dict[str, TierStats]:
        out = {}
        for name, store in (("host", self.host), ("disk", self.disk)):
            if store is None:
                continue
            c = self.counts[name]
            corrupt = self.disk.num_corrupt * CHUNK_BLOCKS if name == "disk" else 0
            out[name] = TierStats(c.stored, c.loaded, c.dropped, corrupt, store.num_bytes,
                                  store.capacity_bytes, tuple(c.load_counts), c.load_seconds)
        return out
