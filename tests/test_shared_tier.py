"""One disk tier shared by several processes (cluster replicas, a restart after a crash):
``write: through`` stores each finished sequence's chunks on disk at once, another tier
over the directory loads them without having indexed them, nothing is written twice,
the size cap holds for the directory, and a writer killed mid-write (``kill -9``, a real
process) leaves no chunk that loads wrong."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
import torch

from slimkv.kv.offload import disk as disk_module
from slimkv.kv.offload.chunk import CHUNK_BLOCKS
from slimkv.kv.offload.disk import HEADER, DiskTier
from tests.test_offload_store import fill
from tests.test_offload_tier import Setup, chain, snapshot


def replica(tmp_path, seed: int, **offload) -> Setup:
    s = Setup(tmp_path, disk_gb=1.0, **{"write": "through", **offload})
    fill(s.cache, seed)
    return s


def test_a_finished_chain_is_on_disk_at_once_and_another_tier_loads_it(tmp_path) -> None:
    a, b = replica(tmp_path, seed=1), replica(tmp_path, seed=2)   # b indexed an empty dir
    hashes = chain(2 * CHUNK_BLOCKS + 5, seed=7)                  # two chunks and a partial
    blocks = a.cache_chain(hashes)
    a.tier.flush()
    assert len(list(tmp_path.glob("*.kv"))) == 3                  # no eviction needed
    assert a.tier.stats()["disk"].stored_blocks == 3 * CHUNK_BLOCKS
    loaded = b.tier.load(hashes, [])
    assert len(loaded) == len(hashes)
    assert torch.equal(snapshot(b.layout, loaded[:CHUNK_BLOCKS]),
                       snapshot(a.layout, blocks[:CHUNK_BLOCKS]))
    assert b.tier.stats()["disk"].loaded_blocks == len(hashes)
    # b finishing the same chain writes nothing again
    b.tier.save(hashes)
    b.tier.flush()
    assert b.tier.stats()["disk"].stored_blocks == 0
    a.tier.close(), b.tier.close()


def test_write_evict_keeps_chunks_in_the_pool_until_evicted(tmp_path) -> None:
    a = replica(tmp_path, seed=1, write="evict")
    a.cache_chain(chain(CHUNK_BLOCKS, seed=8))
    a.tier.flush()
    assert list(tmp_path.glob("*.kv")) == []   # what a killed replica would lose
    a.tier.close()
    assert len(list(tmp_path.glob("*.kv"))) == 1


def test_the_cap_counts_every_process_files(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(disk_module, "REFRESH_S", 0.0)
    a, b = replica(tmp_path, seed=1, host_chunks=0), replica(tmp_path, seed=2, host_chunks=0)
    cap = int(3.5 * a.tier.disk.file_bytes)
    a.tier.disk.capacity_bytes = b.tier.disk.capacity_bytes = cap
    for seed in range(3):
        a.cache_chain(chain(CHUNK_BLOCKS, seed=20 + seed))
        a.tier.flush()
    for seed in range(2):
        b.cache_chain(chain(CHUNK_BLOCKS, seed=30 + seed))
        b.tier.flush()
    assert len(list(tmp_path.glob("*.kv"))) == 3
    a.tier.close(), b.tier.close()


def test_stale_temporary_files_of_dead_writers_are_removed(tmp_path) -> None:
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(0,))
    child.start()
    child.join()
    dead = tmp_path / f"{'ab' * 16}.kv.{disk_module.HOST}.{child.pid}.1.tmp"
    alive = tmp_path / f"{'cd' * 16}.kv.{disk_module.HOST}.{os.getppid()}.1.tmp"
    other_host = tmp_path / f"{'ef' * 16}.kv.elsewhere.{child.pid}.1.tmp"
    for path in (dead, alive, other_host):
        path.write_bytes(b"half a chunk")
    disk = DiskTier(str(tmp_path), 1 << 30, b"d" * 16, 64)
    assert disk.num_stale_tmp == 1 and not dead.exists()
    assert alive.exists() and other_host.exists()


def _write_forever(path: str, digest: bytes, size: int) -> None:
    disk = DiskTier(path, 1 << 30, digest, size)
    for i in range(10_000):
        key = i.to_bytes(16, "big")
        disk.put(key, torch.full((size,), i % 251, dtype=torch.uint8))


@pytest.mark.slow
def test_a_writer_killed_mid_write_leaves_no_bad_chunk(tmp_path) -> None:
    digest, size = b"k" * 16, 4 << 20          # 4 MiB chunks: a kill lands mid-file
    ctx = multiprocessing.get_context("spawn")   # fork after torch's threads may hang
    for _ in range(2):
        writer = ctx.Process(target=_write_forever, args=(str(tmp_path), digest, size))
        writer.start()
        deadline = time.monotonic() + 20
        start = len(list(tmp_path.glob("*.kv")))
        while len(list(tmp_path.glob("*.kv"))) < start + 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.037)
        os.kill(writer.pid, signal.SIGKILL)
        writer.join()
    disk = DiskTier(str(tmp_path), 1 << 30, digest, size)
    assert disk.num_corrupt == 0 and not list(tmp_path.glob("*.tmp"))
    for path in tmp_path.glob("*.kv"):
        assert path.stat().st_size == HEADER.size + size
        key = bytes.fromhex(path.name[:-3])
        got = disk.get(key)
        assert got is not None and bool((got == int.from_bytes(key, "big") % 251).all())
    assert disk.num_corrupt == 0
