"""Memory profiling: the live-bytes tracker and the measured split of a real SmolLM2 workload."""

from __future__ import annotations

import pytest
import torch

from slimkv.config import Config
from slimkv.engine.memory import LiveBytes
from slimkv.profile_cli import recommend, run_workload


def test_live_bytes_counts_new_storages_once_and_ignores_old_ones() -> None:
    old = torch.zeros(1000)
    with LiveBytes() as tracker:
        a = torch.ones(1000)                 # 4000 B
        view = a[:10]                        # same storage: not counted again
        old.add_(1)                          # in place on a pre-existing tensor: not counted
        b = a * 2                            # 8000 B live
        del a, view, b
        c = torch.ones(500, dtype=torch.float64)   # 4000 B, after the others were freed
        del c
    assert tracker.peak == 8000
    assert tracker.live == 0


@pytest.mark.slow
def test_profile_kv_bytes_int8_vs_bfloat16() -> None:
    from slimkv.plugins import build_engine

    reports = {}
    for kv in ("bfloat16", "int8"):
        engine = build_engine(Config.from_dict({"kv_cache": {"dtype": kv, "num_blocks": 64,
                                                             "k_scale": "per_token"},
                                                "scheduler": {"max_num_batched_tokens": 128}}))
        m = run_workload(engine, sessions=2, context=48)
        assert m["kv_allocated"] == engine.pool.num_blocks * engine.runner.cache.bytes_per_block
        assert m["kv_allocated"] == engine.memory_split()["kv_cache"]
        assert m["kv_in_use"] == m["kv_blocks_in_use"] * engine.runner.cache.bytes_per_block
        assert m["kv_blocks_in_use"] == 2 * -(-48 // engine.runner.cache.block_size)
        assert m["weights"] > 0 and m["activations"] > 0 and m["activations_startup"] > 0
        share, advice = recommend(engine, m, 2, 48)
        assert 0 < share < 1 and "KV cache is" in advice
        reports[kv] = m
    # int8: 1 byte per element plus one float16 scale per 64-element token-head, K and V.
    ratio = reports["int8"]["kv_allocated"] / reports["bfloat16"]["kv_allocated"]
    assert ratio == (64 + 2) / (2 * 64)
    assert reports["int8"]["weights"] == reports["bfloat16"]["weights"]
