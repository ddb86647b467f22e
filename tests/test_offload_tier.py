"""The offload tier's write-back and loading against a small pool, without a model."""

from __future__ import annotations

import threading

import pytest
import torch

from slimkv.kv.offload.config import OffloadConfig
from slimkv.kv.block_pool import BlockPool, hash_block
from slimkv.kv.offload.chunk import CHUNK_BLOCKS, ChunkLayout
from slimkv.kv.offload.tier import OffloadTier
from tests.test_offload_store import MODEL, fill, make_cache

GiB = 1 << 30


def chain(n: int, seed: int) -> list[bytes]:
    hashes, parent = [], None
    for i in range(n):
        parent = hash_block(parent, [seed, i, 0, 0])
        hashes.append(parent)
    return hashes


class Setup:
    def __init__(self, tmp_path=None, host_chunks: float = 8.5, num_blocks: int = 64,
                 **offload) -> None:
        self.cache = make_cache(num_blocks=num_blocks)
        fill(self.cache)
        self.layout = ChunkLayout(self.cache, MODEL, "float32")
        gib = self.layout.num_bytes / GiB
        config = OffloadConfig(host_gb=host_chunks * gib,
                               disk_path=None if tmp_path is None else str(tmp_path),
                               **offload)
        self.tier = OffloadTier(self.layout, config)
        self.pool = BlockPool(num_blocks)
        self.tier.attach(self.pool)

    def cache_chain(self, hashes: list[bytes]) -> list:
        """Blocks holding ``hashes`` (as a finished sequence leaves them) and their bytes."""
        blocks = self.pool.get_new_blocks(len(hashes))
        for block, h in zip(blocks, hashes):
            self.pool.cache_block(block, h)
        self.tier.save(hashes)
        self.pool.free_blocks(reversed(blocks))
        return blocks

    def evict_all(self) -> None:
        self.pool.free_blocks(self.pool.get_new_blocks(self.pool.num_blocks))
        self.tier.flush()


def snapshot(layout: ChunkLayout, blocks) -> torch.Tensor:
    return layout.gather([b.block_id for b in blocks])


def test_write_back_on_eviction_and_load_are_bit_identical() -> None:
    s = Setup()
    hashes = chain(2 * CHUNK_BLOCKS + 3, seed=1)
    blocks = s.cache_chain(hashes)
    before = [snapshot(s.layout, blocks[i:i + CHUNK_BLOCKS]) for i in (0, CHUNK_BLOCKS)]
    assert s.tier.stats()["host"].stored_blocks == 0        # nothing written before eviction
    before.append(snapshot(s.layout, blocks[2 * CHUNK_BLOCKS:]))     # a partial chunk
    s.evict_all()
    assert s.tier.stats()["host"].stored_blocks == 3 * CHUNK_BLOCKS
    for i, h in enumerate((hashes[CHUNK_BLOCKS - 1], hashes[2 * CHUNK_BLOCKS - 1], hashes[-1])):
        payload, tier = s.tier.fetch(s.layout.key(h))
        assert tier == "host" and torch.equal(payload, before[i])
    loaded = s.tier.load(hashes, [])
    assert len(loaded) == len(hashes)
    assert [s.pool.cached[h] for h in hashes] == loaded
    assert all(b.ref_cnt == 0 for b in loaded)
    assert torch.equal(snapshot(s.layout, loaded[:CHUNK_BLOCKS]), before[0])
    assert torch.equal(snapshot(s.layout, loaded[2 * CHUNK_BLOCKS:]), before[2])
    assert s.tier.stats()["host"].loaded_blocks == len(hashes)
    # a longer chain finds the partial chunk, a diverging one stops before it
    s.evict_all()
    assert len(s.tier.load(hashes + chain(2, seed=9), [])) == len(hashes)
    s.evict_all()
    assert len(s.tier.load(hashes[:2 * CHUNK_BLOCKS] + chain(3, seed=9), [])) == \
        2 * CHUNK_BLOCKS


def test_load_continues_after_partial_pool_hits() -> None:
    s = Setup()
    hashes = chain(CHUNK_BLOCKS, seed=2)
    ids = [b.block_id for b in s.cache_chain(hashes)]
    before = {name: t[:, ids].clone() for name, t in s.layout.tensors}
    s.evict_all()
    assert s.tier.load(hashes[:5], []) == []          # the chunk ends after block 5
    head = s.pool.get_new_blocks(5)                            # the pool still holds 5 blocks
    for block, h in zip(head, hashes[:5]):
        s.pool.cache_block(block, h)
    s.pool.free_blocks(head)
    loaded = s.tier.load(hashes, head)
    assert len(loaded) == CHUNK_BLOCKS - 5 and all(b.ref_cnt == 0 for b in head + loaded)
    assert not {b.block_id for b in head} & {b.block_id for b in loaded}
    loaded_ids = [b.block_id for b in loaded]
    for name, t in s.layout.tensors:
        assert torch.equal(t[:, loaded_ids], before[name][:, 5:]), name
    assert s.tier.stats()["host"].loaded_blocks == CHUNK_BLOCKS - 5


def test_stored_chunks_are_not_written_twice() -> None:
    s = Setup()
    hashes = chain(CHUNK_BLOCKS, seed=3)
    s.cache_chain(hashes)
    s.evict_all()
    s.tier.load(hashes, [])
    s.tier.save(hashes)           # the reloaded session finishes again
    s.evict_all()
    assert s.tier.stats()["host"].stored_blocks == CHUNK_BLOCKS


def test_idle_mode_writes_after_idle_s() -> None:
    s = Setup(write="idle", idle_s=10.0)
    hashes = chain(CHUNK_BLOCKS, seed=4)
    blocks = s.pool.get_new_blocks(CHUNK_BLOCKS)
    for block, h in zip(blocks, hashes):
        s.pool.cache_block(block, h)
    s.tier.save(hashes, now=100.0)
    s.pool.free_blocks(reversed(blocks))
    s.tier.tick(now=105.0)
    s.tier.flush()
    assert s.tier.stats()["host"].stored_blocks == 0
    s.tier.tick(now=110.5)
    s.tier.flush()
    assert s.tier.stats()["host"].stored_blocks == CHUNK_BLOCKS
    assert s.pool.cached[hashes[0]] is blocks[0]               # still in the pool too


def test_a_full_writer_queue_drops_and_counts(monkeypatch) -> None:
    s = Setup(queue_chunks=1, num_blocks=4 * CHUNK_BLOCKS)
    entered, release = threading.Event(), threading.Event()
    store = s.tier._store
    monkeypatch.setattr(s.tier, "_store",
                        lambda *a: (entered.set(), release.wait(10), store(*a)))
    for seed in range(4):
        s.cache_chain(chain(CHUNK_BLOCKS, seed=10 + seed))
    s.pool.get_new_blocks(CHUNK_BLOCKS)           # the first write-back: the writer takes it
    assert entered.wait(10)
    s.pool.get_new_blocks(3 * CHUNK_BLOCKS)       # three more while the writer is busy
    release.set()
    s.tier.flush()
    host = s.tier.stats()["host"]
    # one in the writer's hands, one queued, the rest dropped
    assert host.stored_blocks == 2 * CHUNK_BLOCKS and host.dropped_blocks == 2 * CHUNK_BLOCKS


def test_host_spills_to_disk_and_a_tiny_disk_drops(tmp_path) -> None:
    s = Setup(tmp_path, host_chunks=1.5, disk_gb=0)
    for seed in range(3):
        s.cache_chain(chain(CHUNK_BLOCKS, seed=20 + seed))
    s.evict_all()
    stats = s.tier.stats()
    assert stats["host"].stored_blocks == 3 * CHUNK_BLOCKS and stats["host"].num_bytes == \
        s.layout.num_bytes
    assert stats["disk"].stored_blocks == 0 and stats["disk"].dropped_blocks == 2 * CHUNK_BLOCKS
    assert list(tmp_path.iterdir()) == []


def test_close_writes_pending_chunks_and_host_to_disk(tmp_path) -> None:
    s = Setup(tmp_path, host_chunks=4.5, disk_gb=1.0)
    s.cache_chain(chain(CHUNK_BLOCKS, seed=30))
    s.cache_chain(chain(CHUNK_BLOCKS, seed=31))
    s.tier.close()
    assert len(list(tmp_path.glob("*.kv"))) == 2
    s.tier.close()                                  # idempotent


def test_concurrent_writes_and_reads(tmp_path) -> None:
    s = Setup(tmp_path, host_chunks=2.5, num_blocks=CHUNK_BLOCKS, disk_gb=1.0,
              queue_chunks=4)
    expected: dict[bytes, torch.Tensor] = {}
    stop = threading.Event()
    errors = []

    def reader():
        while not stop.is_set():
            for key, want in list(expected.items()):
                found = s.tier.fetch(key)
                if found is not None and not torch.equal(found[0], want):
                    errors.append(key)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for seed in range(12):
        fill(s.cache, seed)
        hashes = chain(CHUNK_BLOCKS, seed=40 + seed)
        blocks = s.cache_chain(hashes)
        expected[s.layout.key(hashes[-1])] = snapshot(s.layout, blocks)
        s.pool.free_blocks(s.pool.get_new_blocks(s.pool.num_blocks))   # write it back
    s.tier.flush()
    stop.set()
    for t in threads:
        t.join()
    stats = s.tier.stats()
    assert not errors
    assert stats["host"].stored_blocks + stats["host"].dropped_blocks == 12 * CHUNK_BLOCKS
    for key, want in expected.items():
        found = s.tier.fetch(key)
        assert found is None or torch.equal(found[0], want)
    s.tier.close()


def test_the_offload_section_is_validated_with_its_key_path() -> None:
    from slimkv.config import ConfigError, KVCacheConfig

    assert OffloadConfig.of(KVCacheConfig(offload={"host_gb": 1})).host_gb == 1
    assert OffloadConfig.of(KVCacheConfig(offload={})) == OffloadConfig()
    for offload, message in (({"hots_gb": 1}, "kv_cache.offload.hots_gb: unknown key"),
                             ({"write": "never"}, "kv_cache.offload.write"),
                             ({"host_gb": 0}, "set host_gb > 0 or a disk_path"),
                             ({"idle_s": -1}, "kv_cache.offload.idle_s")):
        with pytest.raises(ConfigError, match=message):
            OffloadConfig.of(KVCacheConfig(offload=offload))
    with pytest.raises(ConfigError, match="paged KV cache"):
        OffloadConfig.of(KVCacheConfig(offload={}, paged=False))
