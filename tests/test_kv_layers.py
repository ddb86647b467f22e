"""Per-layer mixed precision (``kv_cache.layer_dtypes``): sizing is the sum of the layers'
figures, a mixed cache round-trips every layer through its own codec, the config rejects
bad maps, and an engine with a mix generates."""

from __future__ import annotations

import pytest
import torch

from slimkv.config import Config, ConfigError
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.layers import side_codec
from slimkv.kv.staging import Staging
from slimkv.llm import LLM
from slimkv.engine.sampling import SamplingParams

SMOLLM2 = dict(num_layers=30, num_kv_heads=3, head_dim=64)
SHAPE = dict(**SMOLLM2, block_size=16)
MIX = {"int8": [0, 1, 29], "float32": [7]}
BLOCK = 16


def _per_layer_token_bytes(dtype: str, k_scale: str) -> int:
    """One layer's bytes per token (all KV heads, K and V), from the codecs alone."""
    codecs = (side_codec(dtype, 64, k_scale), side_codec(dtype, 64, "per_token"))
    per_block = sum(c.bytes_per_block_head(BLOCK) for c in codecs) * SMOLLM2["num_kv_heads"]
    assert per_block % BLOCK == 0
    return per_block // BLOCK


@pytest.mark.parametrize("k_scale", ["per_token", "per_channel_block"])
def test_bytes_per_token_is_sum_over_layers(k_scale: str) -> None:
    layer = {d: _per_layer_token_bytes(d, k_scale) for d in ("int4", "int8", "float32")}
    expected = 3 * layer["int8"] + layer["float32"] + 26 * layer["int4"]
    got = PagedKVCache.bytes_per_token(**SHAPE, k_dtype="int4", v_dtype="int4", k_scale=k_scale,
                                       layer_dtypes=MIX)
    assert got == expected
    assert PagedKVCache.block_bytes(**SHAPE, k_dtype="int4", v_dtype="int4", k_scale=k_scale,
                                    layer_dtypes=MIX) == BLOCK * expected


def test_budget_uses_mixed_block_bytes() -> None:
    shape = dict(**SMOLLM2, k_dtype="int4", v_dtype="int4", k_scale="per_token", layer_dtypes=MIX)
    per_block = PagedKVCache.block_bytes(**shape, block_size=BLOCK)
    assert PagedKVCache.num_blocks_for_budget(10 * per_block - 1, **shape, block_size=BLOCK) == 9


def _mixed_cache(k_scale: str = "per_token") -> PagedKVCache:
    return PagedKVCache(num_layers=4, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=64,
                        k_dtype="int4", v_dtype="int4", device=torch.device("cpu"),
                        k_scale=k_scale, layer_dtypes={"int8": [1], "float32": [3]})


def test_mixed_cache_allocates_exactly() -> None:
    cache = _mixed_cache()
    assert cache.nbytes == cache.num_blocks * cache.bytes_per_block
    tensors = cache.tensors()
    assert tensors["k_data[int8]"].shape[0] == 1 and tensors["k_data[int4]"].shape[0] == 2
    assert tensors["v_data[float32]"].dtype == torch.float32
    assert {c.name for c in cache.all_codecs()} == {"int4", "int8", "float32"}
    assert not cache.block_scaled


def test_mixed_cache_round_trips_each_layer_through_its_codec() -> None:
    cache = _mixed_cache()
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(8, 16)
    blocks = torch.tensor([2, 3])
    for layer in range(4):
        k, v = (torch.randn(8, 2, 64, generator=gen) for _ in range(2))
        cache.write(layer, slots, k, v)
        got_k, got_v = cache.read(layer, blocks, torch.float32)
        for side, x, got in (("k", k, got_k), ("v", v, got_v)):
            codec = cache.layer_codecs[layer][side]
            assert torch.equal(got, codec.dequantize(codec.quantize(x), torch.float32))
    assert torch.equal(cache.read(3, blocks, torch.float32)[0], k)  # float32 layer exact


@pytest.mark.parametrize("layer_dtypes", [None, {"int4": [1], "float32": [3]}])
def test_writing_every_layer_at_once_stores_what_layer_by_layer_writes_store(layer_dtypes):
    shape = dict(num_layers=4, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=64,
                 k_dtype="int8", v_dtype="int8", device=torch.device("cpu"),
                 k_scale="per_channel_block", layer_dtypes=layer_dtypes)
    at_once, by_layer = PagedKVCache(**shape), PagedKVCache(**shape)
    k, v = torch.randn(2, 4, 2, 4, 2, 64).unbind(0)  # [layers, n, block_size, H, D]
    ids = torch.tensor([3, 1])
    at_once.write_blocks_all_layers(ids, k, v)
    for layer in range(4):
        by_layer.write_blocks(layer, ids, k[layer], v[layer])
    for name, t in by_layer.tensors().items():
        assert torch.equal(at_once.tensors()[name], t), name


def test_staged_when_any_layer_has_block_scales() -> None:
    cache = PagedKVCache(num_layers=2, num_blocks=3, block_size=4, num_kv_heads=1, head_dim=64,
                         k_dtype="float32", v_dtype="float32", device=torch.device("cpu"),
                         k_scale="per_channel_block", layer_dtypes={"int4": [1]})
    assert cache.block_scaled
    assert Staging.needed("float32", "float32", 64, "per_channel_block", {"int4": [1]})
    assert not Staging.needed("float32", "float32", 64, "per_channel_block")


@pytest.mark.parametrize("value, message", [
    ([0, 1], "must map a KV dtype"),
    ({"int3": [0]}, "unknown value 'int3'"),
    ({"auto": [0]}, "unknown value 'auto'"),
    ({"int8": []}, "non-empty list"),
    ({"int8": [0, -1]}, "integers >= 0"),
    ({"int8": ["0"]}, "integers >= 0"),
    ({"int8": [0], "fp8": [2, 0]}, "layer 0 is also listed under int8"),
])
def test_config_rejects_bad_layer_dtypes(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Config.from_dict({"kv_cache": {"dtype": "int4", "layer_dtypes": value}})


def test_config_accepts_yaml_map(tmp_path) -> None:
    path = tmp_path / "mix.yaml"
    path.write_text("kv_cache:\n  dtype: int4\n  layer_dtypes: {int8: [0, 1, 29]}\n")
    assert Config.load(path).kv_cache.layer_dtypes == {"int8": [0, 1, 29]}


def test_layer_out_of_range() -> None:
    with pytest.raises(ConfigError, match="layer 30, but the model has 30 layers"):
        PagedKVCache.bytes_per_token(**SHAPE, k_dtype="int4", v_dtype="int4",
                                     k_scale="per_token", layer_dtypes={"int8": [30]})


@pytest.mark.slow
def test_engine_with_a_mix_generates() -> None:
    config = Config().replace("kv_cache", dtype="int4", num_blocks=64,
                              layer_dtypes={"int8": [0, 29], "float32": [5]})
    llm = LLM(config)
    engine = llm.engine
    assert engine.runner.bytes_per_token == PagedKVCache.bytes_per_token(
        **SHAPE, k_dtype="int4", v_dtype="int4", k_scale=config.kv_cache.k_scale,
        layer_dtypes=config.kv_cache.layer_dtypes)
    # The sink region's ids (kv_cache.int4.sink_block, on with an int4 layer) come on top.
    assert engine.runner.num_sink > 0 and engine.pool.num_blocks == 64
    assert engine.runner.cache.nbytes == (64 + engine.runner.num_sink) * engine.runner.cache.bytes_per_block
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    [result] = llm.generate("The capital of France is", params)
    assert len(result.token_ids) == 20
    assert engine.runner.attention.backend.fallback_reason is None
