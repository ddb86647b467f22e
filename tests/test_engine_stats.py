"""The engine's stats snapshot: counter increments computed in one place, block states."""

from __future__ import annotations

from conftest import engine_stats as _stats

from slimkv.kv.block_pool import BlockPool, hash_block
from slimkv.server.metrics import CounterDeltas


def test_counter_deltas_are_increments_since_the_last_call() -> None:
    deltas = CounterDeltas()
    assert deltas(_stats()) == {}
    first = _stats(prefix_queries=40, prefix_hits=16, attention_paths={"fused_decode": 30},
                   finished={"stop": 1})
    assert deltas(first) == {"prefix_queries": 40, "prefix_hits": 16, "path:fused_decode": 30,
                             "finished:stop": 1}
    assert deltas(first) == {}
    later = _stats(prefix_queries=50, prefix_hits=16, preemptions=2,
                   attention_paths={"fused_decode": 60, "fast_prefill": 30}, finished={"stop": 1})
    assert deltas(later) == {"prefix_queries": 10, "preemptions": 2, "path:fused_decode": 30,
                             "path:fast_prefill": 30}


def test_usage_counts_held_blocks_only() -> None:
    stats = _stats(num_free_blocks=7)
    assert stats.num_blocks_used == 3 and stats.usage == 0.3


def test_block_states_follow_the_pool() -> None:
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    assert {a.state, b.state, c.state, pool.blocks[3].state} == {"in_use", "free"}
    pool.cache_block(a, hash_block(None, [1, 2]))
    pool.set_session_head([b], "s1")
    pool.free_blocks([a, b, c])
    assert (a.state, b.state, c.state) == ("cached", "pinned", "free")
