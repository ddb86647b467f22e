"""The offload tier in the engine: a session evicted from the pool to host memory or disk
and continued gives exactly the logits of one never evicted (reloaded blocks are
bit-identical), and a new engine over the same directory finds it."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from slimkv.config import ConfigError
from slimkv.engine.llm_engine import LLMEngine
from slimkv.kv.cache import PagedKVCache
from slimkv.model_io import load, read_model_args
from slimkv.plugins import build_engine
from slimkv.kv.offload.chunk import CHUNK_BLOCKS
from slimkv.kv.offload.disk import HEADER
from slimkv.engine.sampling import SamplingParams
from slimkv.engine.sequence import Sequence
from tests.conftest import small_config

pytestmark = pytest.mark.slow
GiB = 1 << 30
_ids = itertools.count()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def tail_logits(engine: LLMEngine, ids: list[int]) -> tuple[int, torch.Tensor]:
    """Admit ``ids`` with whatever prefix the caches hold, and return the number of cached
    tokens and the logits of the rest (then free the sequence, as a finished request)."""
    seq = Sequence(f"t{next(_ids)}", ids, SamplingParams(max_tokens=1))
    manager = engine.manager
    computed = manager.get_computed_blocks(seq)
    n = len(ids) - len(computed) * manager.block_size
    assert manager.can_allocate(seq, n, computed)
    manager.allocate(seq, n, computed)
    logits = engine.runner.logits(seq, n)
    seq.num_computed_tokens += n
    manager.cache_full_blocks(seq)
    manager.free(seq)
    return len(computed) * manager.block_size, logits


def chunk_gib(config, num_chunks: float) -> float:
    args, kv = read_model_args(None), config.kv_cache
    per_block = PagedKVCache.block_bytes(
        args.num_layers, args.num_kv_heads, args.head_dim, kv.k_dtype or kv.dtype, kv.v_dtype or kv.dtype,
        kv.k_scale, kv.block_size, kv.layer_dtypes)
    return num_chunks * CHUNK_BLOCKS * per_block / GiB


def offload_config(tmp_path, kv: dict, host_chunks: float, **offload):
    base = small_config(kv_cache={"num_blocks": 48, **kv})
    host_gb = chunk_gib(base, host_chunks) if host_chunks else 0
    return base.replace("kv_cache", offload={"host_gb": host_gb, "disk_path": str(tmp_path),
                                             "disk_gb": 1.0, **offload})


DOC = tokens(2 * CHUNK_BLOCKS * 16, seed=1)          # two chunks
TURN2 = DOC + tokens(37, seed=2)


def evict_everything(engine: LLMEngine) -> None:
    """Hand out every block of the pool at once (pinned session heads included), to a
    sequence that caches nothing, and free it."""
    seq = Sequence(f"e{next(_ids)}", tokens(engine.pool.num_blocks * 16, 3), SamplingParams())
    engine.manager.allocate(seq, seq.num_tokens)
    engine.manager.free(seq)
    engine.connector.flush()
    assert not any(b.block_hash in engine.manager._block_hashes(
        Sequence("x", DOC, SamplingParams()), 32) for b in engine.pool.blocks)


KV_FORMATS = {
    "int8": {},
    "bf16": {"dtype": "bfloat16"},
    "int4": {"dtype": "int4", "k_scale": "per_token"},
    # The tier keeps no float sink block: the reference without the tier keeps none either.
    "mix": {"layer_dtypes": {"float16": [0, 1], "int4": [2, 29]}, "int4": {"sink_block": False}},
}


_references: dict[str, torch.Tensor] = {}


def reference_logits(name: str) -> torch.Tensor:
    """TURN2's logits after DOC, on an engine without the tier that never evicts."""
    if name not in _references:
        engine = build_engine(small_config(kv_cache={"num_blocks": 48, **KV_FORMATS[name]}))
        tail_logits(engine, DOC)
        cached, _references[name] = tail_logits(engine, TURN2)
        assert cached == len(DOC)
    return _references[name]


@pytest.mark.parametrize("name", KV_FORMATS)
def test_reloaded_session_gives_the_never_evicted_logits(tmp_path, name) -> None:
    # one chunk fits in host memory: the other spills to disk, so both tiers are read
    engine = build_engine(offload_config(tmp_path, KV_FORMATS[name], host_chunks=1.5))
    tail_logits(engine, DOC)
    evict_everything(engine)
    stats = engine.stats().offload
    assert stats["host"].stored_blocks == 2 * CHUNK_BLOCKS      # both went through host
    assert stats["disk"].stored_blocks == CHUNK_BLOCKS          # the first spilled
    cached, logits = tail_logits(engine, TURN2)                 # prefix from host and disk
    assert cached == len(DOC) and engine.manager.num_prefix_hits == len(DOC)
    assert torch.equal(logits, reference_logits(name))
    stats = engine.stats().offload
    assert stats["host"].loaded_blocks == stats["disk"].loaded_blocks == CHUNK_BLOCKS
    assert sum(stats["disk"].load_counts) == 1 and stats["disk"].load_seconds > 0
    engine.connector.close()


def test_a_restarted_engine_reuses_the_directory(tmp_path) -> None:
    config = offload_config(tmp_path, {}, host_chunks=4, write="idle", idle_s=0)
    first = build_engine(config)
    tail_logits(first, DOC)
    first.connector.close()                                       # host chunks go to disk
    files = list(tmp_path.glob("*.kv"))
    assert len(files) == 2 and all(f.stat().st_size > HEADER.size for f in files)
    second = build_engine(config)
    assert second.stats().offload["disk"].num_bytes == sum(f.stat().st_size for f in files)
    cached, logits = tail_logits(second, TURN2)
    assert cached == len(DOC) and torch.equal(logits, reference_logits("int8"))
    assert second.stats().offload["disk"].loaded_blocks == 2 * CHUNK_BLOCKS
    second.connector.close()


def test_idle_chunks_are_written_when_a_later_request_finishes(tmp_path) -> None:
    engine = build_engine(offload_config(tmp_path, {}, host_chunks=4, write="idle", idle_s=0))
    tail_logits(engine, DOC)
    assert engine.stats().offload["host"].stored_blocks == 0
    engine.add_request(tokens(5, seed=9), SamplingParams(max_tokens=1))
    engine.step()
    engine.connector.flush()
    assert engine.stats().offload["host"].stored_blocks == 2 * CHUNK_BLOCKS
    engine.connector.close()


def generate(engine: LLMEngine, ids: list[int], session: str) -> tuple[list[int], int]:
    seq = engine.add_request(ids, SamplingParams(max_tokens=8, temperature=0.0),
                             session_id=session)
    while engine.has_unfinished():
        engine.step()
    return seq.output_token_ids, seq.num_cached_tokens


def test_turns_through_the_engine_loop_hit_the_tier(tmp_path) -> None:
    engine = build_engine(offload_config(tmp_path, {}, host_chunks=0))   # disk only
    out1, _ = generate(engine, DOC, "s")
    follow = DOC + out1 + tokens(20, seed=5)
    ref_engine = build_engine(small_config(kv_cache={"num_blocks": 96}))
    ref_out1, _ = generate(ref_engine, DOC, "s")
    assert ref_out1 == out1
    reference, ref_cached = generate(ref_engine, follow, "s")
    evict_everything(engine)
    out2, cached = generate(engine, follow, "s")
    assert cached == ref_cached >= len(DOC)
    assert out2 == reference
    assert engine.stats().offload["disk"].loaded_blocks == cached // 16
    engine.connector.close()


def test_an_engine_built_without_the_connector_refuses_an_offload_config(tmp_path) -> None:
    with pytest.raises(ConfigError, match="kv_cache.offload"):
        LLMEngine(offload_config(tmp_path, {}, host_chunks=4), load)
