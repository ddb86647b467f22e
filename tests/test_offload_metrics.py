"""The offload tier's metrics and dashboard fields, from an EngineStats snapshot."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from slimkv.kv.offload.stats import LOAD_BUCKETS, TierStats
from slimkv.server.cache_state import CacheHistory
from slimkv.server.metrics import ServerMetrics
from tests.conftest import engine_stats

HOST = TierStats(stored_blocks=64, loaded_blocks=32, dropped_blocks=16, num_bytes=1000,
                 capacity_bytes=4000, load_counts=(1, 2) + (0,) * (len(LOAD_BUCKETS) - 1),
                 load_seconds=0.003)
DISK = TierStats(stored_blocks=16, loaded_blocks=5, corrupt_blocks=16, num_bytes=2000,
                 capacity_bytes=9000, load_counts=(0,) * len(LOAD_BUCKETS) + (4,),
                 load_seconds=7.5)


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.exposition().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_offload_series_per_tier() -> None:
    metrics = ServerMetrics("m")
    metrics.describe_engine(engine_stats(offload={"host": HOST, "disk": DISK}))
    got = samples(metrics)

    def value(name, tier, **extra):
        labels = {"model_name": "m", "tier": tier, **extra}
        return got[(f"slimkv:kv_offload_{name}", tuple(sorted(labels.items())))]

    for tier, t in (("host", HOST), ("disk", DISK)):
        for name in ("stored", "loaded", "dropped", "corrupt"):
            assert value(f"{name}_blocks_total", tier) == getattr(t, f"{name}_blocks")
        assert value("bytes", tier) == t.num_bytes
        assert value("capacity_bytes", tier) == t.capacity_bytes
        assert value("load_seconds_count", tier) == sum(t.load_counts)
        assert value("load_seconds_sum", tier) == t.load_seconds
    assert value("load_seconds_bucket", "host", le=str(LOAD_BUCKETS[0])) == 1
    assert value("load_seconds_bucket", "host", le=str(LOAD_BUCKETS[1])) == 3
    assert value("load_seconds_bucket", "disk", le=str(LOAD_BUCKETS[-1])) == 0
    assert value("load_seconds_bucket", "disk", le="+Inf") == 4


def test_offload_series_follow_the_latest_stats_and_vanish_when_off() -> None:
    metrics = ServerMetrics("m")
    metrics.describe_engine(engine_stats())
    assert not any("kv_offload" in name for name, _ in samples(metrics))
    metrics.update(engine_stats(offload={"host": HOST}), {}, [])
    key = ("slimkv:kv_offload_stored_blocks_total", (("model_name", "m"), ("tier", "host")))
    assert samples(metrics)[key] == 64


def test_cache_state_shows_bytes_per_tier() -> None:
    state = CacheHistory().snapshot(engine_stats(offload={"host": HOST, "disk": DISK}), [],
                                    with_blocks=False)
    assert state["offload"]["host"] == {
        "bytes": 1000, "capacity_bytes": 4000, "stored_blocks": 64, "loaded_blocks": 32,
        "dropped_blocks": 16, "corrupt_blocks": 0}
    assert state["offload"]["disk"]["corrupt_blocks"] == 16
    assert CacheHistory().snapshot(engine_stats(), [], with_blocks=False)["offload"] == {}
