"""The offload tier's storage: chunk layout, host memory and disk files."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from slimkv.kv.block_pool import hash_block
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.offload.chunk import CHUNK_BLOCKS, ChunkLayout
from slimkv.kv.offload.disk import HEADER, DiskTier
from slimkv.kv.offload.host import HostTier

MODEL = b"m" * 16


def make_cache(num_blocks: int = 40, **kw) -> PagedKVCache:
    args = dict(num_layers=3, num_blocks=num_blocks, block_size=4, num_kv_heads=2, head_dim=32,
                k_dtype="int8", v_dtype="int8", device=torch.device("cpu"),
                k_scale="per_channel_block")
    return PagedKVCache(**{**args, **kw})


def fill(cache: PagedKVCache, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    for layer in range(cache.num_layers):
        shape = (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim)
        k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
        cache.write_blocks(layer, torch.arange(cache.num_blocks), k, v)


def payload(layout: ChunkLayout, value: int) -> torch.Tensor:
    return torch.full((layout.num_bytes,), value, dtype=torch.uint8)


@pytest.mark.parametrize("kw", [{}, {"k_dtype": "bfloat16", "v_dtype": "bfloat16"},
                                {"k_dtype": "int4", "v_dtype": "int4", "k_scale": "per_token"},
                                {"layer_dtypes": {"float16": [0], "int4": [2]}}])
def test_chunk_round_trip_is_bit_identical(kw) -> None:
    cache = make_cache(**kw)
    fill(cache)
    layout = ChunkLayout(cache, MODEL, "float32")
    src = list(range(3, 3 + CHUNK_BLOCKS))
    data = layout.gather(src)
    assert data.dtype == torch.uint8 and data.numel() == layout.num_bytes
    assert layout.num_bytes == CHUNK_BLOCKS * cache.bytes_per_block
    dst = list(range(20, 20 + CHUNK_BLOCKS - 5))
    layout.scatter(data, dst, first=5)
    for name, t in cache.tensors().items():
        assert torch.equal(t[:, src[5:]], t[:, dst]), name
    for layer in range(cache.num_layers):
        a = cache.read(layer, torch.tensor(src[5:]), torch.float32)
        b = cache.read(layer, torch.tensor(dst), torch.float32)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_format_digest_separates_formats_models_and_dtypes() -> None:
    base = ChunkLayout(make_cache(), MODEL, "float32")
    others = [ChunkLayout(make_cache(k_dtype="fp8", v_dtype="fp8"), MODEL, "float32"),
              ChunkLayout(make_cache(k_scale="per_token"), MODEL, "float32"),
              ChunkLayout(make_cache(block_size=8), MODEL, "float32"),
              ChunkLayout(make_cache(layer_dtypes={"int4": [1]}), MODEL, "float32"),
              ChunkLayout(make_cache(), b"n" * 16, "float32"),
              ChunkLayout(make_cache(), MODEL, "bfloat16"),
              # kv_cache.int4: the group size changes the scales' shape, the rotations
              # what the same tensors hold
              ChunkLayout(make_cache(layer_dtypes={"int4": [1]}, int4_group_size=16), MODEL,
                          "float32"),
              ChunkLayout(make_cache(), MODEL, "float32", (True, False)),
              ChunkLayout(make_cache(), MODEL, "float32", (False, True))]
    h = hash_block(None, [1, 2, 3, 4])
    assert ChunkLayout(make_cache(num_blocks=7), MODEL, "float32").key(h) == base.key(h)
    digests = {base.format_digest, *(o.format_digest for o in others)}
    keys = {base.key(h), *(o.key(h) for o in others)}
    assert len(digests) == len(keys) == 1 + len(others)


def test_host_tier_evicts_least_recently_used_and_keeps_its_cap() -> None:
    host = HostTier(capacity_bytes=3 * 100 + 50, chunk_bytes=100)
    assert host.num_slots == 3 and host.capacity_bytes == 300
    chunks = {bytes([i]) * 16: torch.full((100,), i, dtype=torch.uint8) for i in range(5)}
    keys = list(chunks)
    for key in keys[:3]:
        assert host.put(key, chunks[key]) == []
    assert torch.equal(host.get(keys[0]), chunks[keys[0]])   # 0 becomes the most recent
    evicted = host.put(keys[3], chunks[keys[3]])
    assert [k for k, _ in evicted] == [keys[1]] and torch.equal(evicted[0][1], chunks[keys[1]])
    assert host.keys() == [keys[2], keys[0], keys[3]]
    assert host.num_bytes == 300 and host.get(keys[1]) is None
    for key in keys:
        got = host.get(key)
        assert got is None or torch.equal(got, chunks[key])


def test_host_tier_without_room_hands_the_chunk_back() -> None:
    host = HostTier(capacity_bytes=50, chunk_bytes=100)
    data = torch.zeros(100, dtype=torch.uint8)
    assert host.num_slots == 0 and host.put(b"k" * 16, data)[0][0] == b"k" * 16


def disk_tier(path, layout: ChunkLayout, num_files: float = 100) -> DiskTier:
    return DiskTier(str(path), int(num_files * (HEADER.size + layout.num_bytes)),
                    layout.format_digest, layout.num_bytes)


@pytest.fixture()
def layout() -> ChunkLayout:
    return ChunkLayout(make_cache(), MODEL, "float32")


def test_disk_round_trip_and_restart_index(tmp_path, layout) -> None:
    disk = disk_tier(tmp_path, layout)
    keys = [bytes([i]) * 16 for i in range(3)]
    for i, key in enumerate(keys):
        assert disk.put(key, payload(layout, i)) == (True, 0)
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    again = disk_tier(tmp_path, layout)
    assert len(again) == 3 and again.num_bytes == 3 * again.file_bytes
    for i, key in enumerate(keys):
        assert torch.equal(again.get(key), payload(layout, i))
    assert again.get(b"z" * 16) is None and again.num_corrupt == 0


def test_disk_cap_evicts_oldest_files(tmp_path, layout) -> None:
    disk = disk_tier(tmp_path, layout, num_files=2.5)
    keys = [bytes([i]) * 16 for i in range(4)]
    disk.put(keys[0], payload(layout, 0))
    disk.put(keys[1], payload(layout, 1))
    assert disk.get(keys[0]) is not None                  # 0 becomes the most recent
    assert disk.put(keys[2], payload(layout, 2)) == (True, 1)
    assert len(disk) == 2 and disk.get(keys[1]) is None
    assert sorted(os.listdir(tmp_path)) == sorted(k.hex() + ".kv" for k in (keys[0], keys[2]))
    assert disk.num_bytes <= disk.capacity_bytes


def test_disk_smaller_than_one_chunk_stores_nothing(tmp_path, layout) -> None:
    disk = disk_tier(tmp_path, layout, num_files=0.5)
    assert disk.put(b"a" * 16, payload(layout, 1)) == (False, 0)
    assert os.listdir(tmp_path) == [] and disk.get(b"a" * 16) is None


@pytest.mark.parametrize("damage", ["truncate", "flip", "header", "empty"])
def test_corrupt_files_are_skipped_counted_and_removed(tmp_path, layout, damage) -> None:
    disk = disk_tier(tmp_path, layout)
    key = b"c" * 16
    disk.put(key, payload(layout, 7))
    path = tmp_path / (key.hex() + ".kv")
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[:-10]
    elif damage == "flip":
        data[HEADER.size + 123] ^= 0x40
    elif damage == "header":
        data[:8] = b"NOTSLIM!"
    else:
        data = b""
    path.write_bytes(bytes(data))
    assert disk.get(key) is None and disk.num_corrupt == 1
    assert not path.exists()
    # found on start-up as well
    disk.put(key, payload(layout, 7))
    path.write_bytes(bytes(data))
    again = disk_tier(tmp_path, layout)   # the scan reads headers; a payload flip shows on load
    assert len(again) == (1 if damage == "flip" else 0)
    assert again.get(key) is None and again.num_corrupt == 1 and len(again) == 0


def test_a_key_from_another_format_never_matches(tmp_path, layout) -> None:
    other = ChunkLayout(make_cache(k_dtype="fp8", v_dtype="fp8"), MODEL, "float32")
    h = hash_block(None, [5, 6, 7, 8])
    foreign = disk_tier(tmp_path, other)
    foreign.put(other.key(h), payload(other, 3))
    ours = disk_tier(tmp_path, layout)
    assert len(ours) == 0 and ours.get(layout.key(h)) is None
    # even a file renamed to our key is refused: its header names the other format
    os.rename(tmp_path / (other.key(h).hex() + ".kv"), tmp_path / (layout.key(h).hex() + ".kv"))
    assert ours.get(layout.key(h)) is None and ours.num_corrupt == 1


def test_unwritable_disk_stops_writing_and_logs_once(tmp_path, layout, monkeypatch, caplog) -> None:
    disk = disk_tier(tmp_path, layout)
    disk.put(b"a" * 16, payload(layout, 1))

    def full(*_a, **_k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    assert disk.put(b"b" * 16, payload(layout, 2)) == (False, 0)
    assert disk.put(b"c" * 16, payload(layout, 3)) == (False, 0)
    assert not disk.writable
    assert len([r for r in caplog.records if "cannot write" in r.message]) == 1
    assert torch.equal(disk.get(b"a" * 16), payload(layout, 1))   # reads go on
    assert [p for p in os.listdir(tmp_path)] == [(b"a" * 16).hex() + ".kv"]


def test_concurrent_disk_writes_and_reads(tmp_path, layout) -> None:
    disk = disk_tier(tmp_path, layout, num_files=1000)
    keys = [bytes([i]) * 16 for i in range(24)]
    errors = []

    def writer(part):
        for i in part:
            disk.put(keys[i], payload(layout, i))

    def reader():
        for _ in range(3):
            for i, key in enumerate(keys):
                got = disk.get(key)
                if got is not None and not torch.equal(got, payload(layout, i)):
                    errors.append(i)

    threads = [threading.Thread(target=writer, args=(range(j, 24, 3),)) for j in range(3)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and disk.num_corrupt == 0 and len(disk) == 24
