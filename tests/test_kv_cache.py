"""The preallocated paged KV pool: sizing arithmetic, allocation, write/read by slot."""

from __future__ import annotations

import pytest
import torch

from slimkv.kv.cache import PagedKVCache

SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64, k_scale="per_token", block_size=16)
QUANTIZED = ["int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int4"]


def _cache(k_dtype: str, v_dtype: str | None = None, *, num_blocks: int = 6,
           block_size: int = 4) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_blocks=num_blocks, block_size=block_size,
                        num_kv_heads=2, head_dim=64, k_dtype=k_dtype,
                        v_dtype=v_dtype or k_dtype, k_scale="per_token", device=torch.device("cpu"))


@pytest.mark.parametrize("dtype, expected", [
    ("float32", 46_080), ("bfloat16", 23_040), ("float16", 23_040),
    ("int8", 11_880), ("fp8", 11_880), ("fp8_e4m3", 11_880), ("fp8_e5m2", 11_880),
    ("int4", 7_200),
])
def test_bytes_per_token_smollm2(dtype: str, expected: int) -> None:
    assert PagedKVCache.bytes_per_token(**SMOLLM2, k_dtype=dtype, v_dtype=dtype) == expected


def test_bytes_per_token_mixed_k_and_v() -> None:
    assert PagedKVCache.bytes_per_token(**SMOLLM2, k_dtype="int8", v_dtype="int4") == (
        11_880 + 7_200) // 2


@pytest.mark.parametrize("k_dtype, v_dtype", [
    ("float32", "float32"), ("bfloat16", "bfloat16"), ("int8", "int8"), ("fp8", "fp8"),
    ("fp8_e5m2", "fp8_e5m2"), ("int4", "int4"), ("int8", "int4"),
])
def test_allocated_bytes_match_arithmetic(k_dtype: str, v_dtype: str) -> None:
    cache = _cache(k_dtype, v_dtype)
    assert cache.nbytes == cache.num_blocks * cache.bytes_per_block
    assert cache.bytes_per_block == cache.block_size * PagedKVCache.bytes_per_token(
        num_layers=2, num_kv_heads=2, head_dim=64, k_dtype=k_dtype, v_dtype=v_dtype,
        k_scale="per_token", block_size=cache.block_size)


def test_int4_data_is_half_of_int8() -> None:
    int8, int4 = _cache("int8").tensors(), _cache("int4").tensors()
    assert int4["k_data"].nbytes * 2 == int8["k_data"].nbytes
    assert int4["k_data"].dtype == torch.uint8 and int4["k_data"].shape[-1] == 32
    assert set(int4) == {"k_data", "k_scale", "k_zero", "v_data", "v_scale", "v_zero"}
    assert set(_cache("float32").tensors()) == {"k_data", "v_data"}


def test_num_blocks_for_budget() -> None:
    per_block = 16 * 11_880
    args = {**SMOLLM2, "k_dtype": "int8", "v_dtype": "int8"}
    assert PagedKVCache.num_blocks_for_budget(10 * per_block, **args) == 10
    assert PagedKVCache.num_blocks_for_budget(10 * per_block - 1, **args) == 9
    assert PagedKVCache.num_blocks_for_budget(2**30, **args) == 2**30 // per_block


def _write_random(cache: PagedKVCache, layer: int, slots: list[int], seed: int = 0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, len(slots), cache.num_kv_heads, cache.head_dim, generator=gen)
    cache.write(layer, torch.tensor(slots), k, v)
    return k, v


def test_float32_write_read_is_exact() -> None:
    cache = _cache("float32")
    slots = [4 * 3 + 0, 4 * 3 + 1, 4 * 3 + 2, 4 * 1 + 0]  # block 3 then block 1
    k, v = _write_random(cache, layer=1, slots=slots)
    read_k, read_v = cache.read(1, torch.tensor([3, 1]), torch.float32)
    assert read_k.shape == (8, 2, 64)
    torch.testing.assert_close(read_k[[0, 1, 2, 4]], k, rtol=0, atol=0)
    torch.testing.assert_close(read_v[[0, 1, 2, 4]], v, rtol=0, atol=0)


@pytest.mark.parametrize("k_dtype, v_dtype, atol", [
    ("int8", "int8", 0.02), ("fp8_e4m3", "fp8_e4m3", 0.25), ("fp8_e5m2", "fp8_e5m2", 0.5),
    ("int4", "int4", 0.5), ("int8", "int4", 0.5),
])
def test_quantized_write_read_within_bounds(k_dtype: str, v_dtype: str, atol: float) -> None:
    cache = _cache(k_dtype, v_dtype)
    k, v = _write_random(cache, layer=0, slots=list(range(8, 16)))
    read_k, read_v = cache.read(0, torch.tensor([2, 3]), torch.float32)
    torch.testing.assert_close(read_k, k, rtol=0, atol=atol)
    torch.testing.assert_close(read_v, v, rtol=0, atol=atol)
    codec_k = cache.codecs["k"]
    torch.testing.assert_close(read_k, codec_k.dequantize(codec_k.quantize(k), torch.float32))


def test_read_batched_block_tables() -> None:
    cache = _cache("int8")
    k, _ = _write_random(cache, layer=0, slots=list(range(24)))
    read_k, _ = cache.read(0, torch.tensor([[5, 0], [2, 2]]), torch.bfloat16)
    assert read_k.shape == (2, 8, 2, 64) and read_k.dtype == torch.bfloat16
    expected = cache.read(0, torch.tensor([5, 0, 2, 2]), torch.bfloat16)[0].view(2, 8, 2, 64)
    torch.testing.assert_close(read_k, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_write_touches_only_its_slots(dtype: str) -> None:
    cache = _cache(dtype)
    _write_random(cache, layer=0, slots=list(range(24)), seed=1)
    _write_random(cache, layer=1, slots=list(range(24)), seed=1)
    before = {name: t.clone() for name, t in cache.tensors().items()}
    _write_random(cache, layer=0, slots=[9, 10], seed=2)  # block 2, offsets 1 and 2
    for name, t in cache.tensors().items():
        changed = (t != before[name]).flatten(3).any(-1)  # [layer, block, offset]
        assert not changed[1].any(), name
        assert not changed[0].flatten()[[s for s in range(24) if s not in (9, 10)]].any(), name
    assert (cache.tensors()["k_data"][0, 2, 1:3] != before["k_data"][0, 2, 1:3]).any()


def test_unknown_dtype_is_rejected() -> None:
    with pytest.raises(ValueError, match="int2"):
        _cache("int2")
