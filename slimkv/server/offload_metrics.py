"""Prometheus series of the KV offload tier (``kv_cache.offload``), rendered at scrape time
from the latest :class:`~slimkv.engine.engine_stats.EngineStats` the engine thread handed over:
the tier keeps monotonic totals and cumulative load-latency buckets, so the exposition is
the engine's own numbers, never increments re-counted here. Nothing is exported while the
tier is off."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.registry import Collector

from slimkv.kv.offload.stats import LOAD_BUCKETS, TierStats

COUNTERS = {
    "stored": "Blocks written to the tier (16 per chunk).",
    "loaded": "Blocks loaded from the tier into the pool instead of recomputed.",
    "dropped": "Blocks not stored (writer queue full, disk full or capped) or pushed out.",
    "corrupt": "Blocks in chunk files found corrupt, skipped and removed.",
}


class OffloadCollector(Collector):
    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.tiers: Mapping[str, TierStats] = {}

    def update(self, tiers: Mapping[str, TierStats]) -> None:
        self.tiers = tiers   # a frozen snapshot: swapped whole, read by the scrape thread

    def collect(self) -> Iterator:
        tiers = self.tiers
        if not tiers:
            return
        labels = ["model_name", "tier"]
        for name, doc in COUNTERS.items():
            family = CounterMetricFamily(f"slimkv:kv_offload_{name}_blocks", doc, labels=labels)
            for tier, t in tiers.items():
                family.add_metric([self.model_name, tier], getattr(t, f"{name}_blocks"))
            yield family
        for name, doc in (("bytes", "Bytes the tier holds."),
                          ("capacity_bytes", "The tier's size cap in bytes.")):
            family = GaugeMetricFamily(f"slimkv:kv_offload_{name}", doc, labels=labels)
            for tier, t in tiers.items():
                family.add_metric([self.model_name, tier],
                                  t.num_bytes if name == "bytes" else t.capacity_bytes)
            yield family
        family = HistogramMetricFamily("slimkv:kv_offload_load_seconds",
                                       "Time to find and load one chunk into the pool.",
                                       labels=labels)
        for tier, t in tiers.items():
            cumulative, total = [], 0
            for bound, count in zip((*map(str, LOAD_BUCKETS), "+Inf"), t.load_counts):
                total += count
                cumulative.append((bound, total))
            family.add_metric([self.model_name, tier], cumulative, t.load_seconds)
        yield family
