"""The KV cache state behind ``GET /v1/cache/state`` and the dashboard.

Everything here runs on the engine thread: :class:`CacheHistory` is a step hook of the
:class:`~slimkv.server.async_engine.AsyncEngine` (it gets the step's
:class:`~slimkv.engine.engine_stats.EngineStats` and counter increments), and
:meth:`CacheHistory.snapshot` is posted with ``AsyncEngine.call``, so it reads the engine's
stats and block map between two steps and returns plain data that the handler serialises. The schema is documented in docs/serving.md;
``SCHEMA_VERSION`` changes only when a field is removed or changes meaning.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from slimkv.engine.engine_stats import BlockInfo, EngineStats
from slimkv.engine.outputs import RequestOutput
from slimkv.workload import percentile

SCHEMA_VERSION = 1
WINDOW_S = 60
# Every state a block can be reported in (see BlockInfo); "staging" appears when the KV
# scheme keeps a full-precision staging block per running sequence (per-block key scales).
STATES = ("free", "in_use", "cached", "pinned", "staging")
COUNTERS = ("evictions", "preemptions", "prefix_queries", "prefix_hits")


class RecentCounts:
    """Per-second increments of monotonic engine counters over the last ``WINDOW_S`` s."""

    def __init__(self) -> None:
        self._seconds: deque[tuple[int, dict[str, int]]] = deque()

    def record(self, now: float, deltas: dict[str, int]) -> None:
        second = int(now)
        if any(deltas.get(name) for name in COUNTERS):
            if not self._seconds or self._seconds[-1][0] != second:
                self._seconds.append((second, dict.fromkeys(COUNTERS, 0)))
            for name in COUNTERS:
                self._seconds[-1][1][name] += deltas.get(name, 0)
        while self._seconds and self._seconds[0][0] <= second - WINDOW_S:
            self._seconds.popleft()

    def series(self, now: float, name: str) -> list[int]:
        """Counts per second, oldest first; the last entry is the current second."""
        start = int(now) - WINDOW_S + 1
        out = [0] * WINDOW_S
        for second, counts in self._seconds:
            if second >= start:
                out[second - start] = counts[name]
        return out


class RecentTTFT:
    """Time-to-first-token samples of the requests that started in the last minute."""

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, now: float, ttft: float) -> None:
        self._samples.append((now, ttft))

    def summary(self, now: float) -> dict[str, Any]:
        while self._samples and self._samples[0][0] < now - WINDOW_S:
            self._samples.popleft()
        values = [ttft for _, ttft in self._samples]
        return {"window_s": WINDOW_S, "count": len(values),
                "p50_s": percentile(values, 50), "p99_s": percentile(values, 99)}


class CacheHistory:
    """Recent events (a step hook) and the snapshot (posted to the engine thread)."""

    def __init__(self) -> None:
        self.counts = RecentCounts()
        self.ttft = RecentTTFT()

    def __call__(self, stats: EngineStats, deltas: dict[str, int],
                 outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        self.counts.record(now, deltas)
        for out in outputs:
            if out.ttft is not None:
                self.ttft.add(now, out.ttft)

    def snapshot(self, stats: EngineStats, block_map: list[BlockInfo],
                 with_blocks: bool = True) -> dict[str, Any]:
        now = time.monotonic()
        blocks = [block_entry(block, stats.block_size) for block in block_map]
        counts = dict.fromkeys(STATES, 0)
        for block in blocks:
            counts[block["state"]] += 1
        state = {
            "schema_version": SCHEMA_VERSION,
            "time": time.time(),
            "step": stats.step,
            "model": stats.model_name,
            "pool": pool_summary(stats, blocks),
            "counts": counts,
            "requests": request_summary(stats),
            "memory": {**stats.memory, "kv_bytes_per_token": stats.bytes_per_token,
                       "k_dtype": stats.k_dtype, "v_dtype": stats.v_dtype},
            "prefix_cache": self._prefix_summary(stats, now),
            "events": {"window_s": WINDOW_S, "evictions_total": stats.evictions,
                       "preemptions_total": stats.preemptions,
                       **{name: self.counts.series(now, name)
                          for name in ("evictions", "preemptions")}},
            "ttft": self.ttft.summary(now),
            "offload": offload_summary(stats),
        }
        if with_blocks:
            state["blocks"] = blocks
        return state

    def _prefix_summary(self, stats: EngineStats, now: float) -> dict[str, Any]:
        recent_q = sum(self.counts.series(now, "prefix_queries"))
        recent_h = sum(self.counts.series(now, "prefix_hits"))
        return {"queries_total": stats.prefix_queries, "hits_total": stats.prefix_hits,
                "hit_rate": ratio(stats.prefix_hits, stats.prefix_queries),
                "hit_rate_recent": ratio(recent_h, recent_q), "window_s": WINDOW_S}


def offload_summary(stats: EngineStats) -> dict[str, Any]:
    """Per offload tier (``host``, ``disk``; ``{}`` when the tier is off): bytes held, cap,
    and block counters since start."""
    return {tier: {"bytes": t.num_bytes, "capacity_bytes": t.capacity_bytes,
                   "stored_blocks": t.stored_blocks, "loaded_blocks": t.loaded_blocks,
                   "dropped_blocks": t.dropped_blocks, "corrupt_blocks": t.corrupt_blocks}
            for tier, t in stats.offload.items()}


def ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def pool_summary(stats: EngineStats, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    return {"num_blocks": stats.num_blocks, "block_size": stats.block_size,
            "num_free_blocks": stats.num_free_blocks, "usage": stats.usage,
            "watermark": stats.watermark, "watermark_alert": stats.watermark_alert,
            "evict_policy": stats.evict_policy,
            "clock": max((b["last_used"] for b in blocks), default=0)}


def request_summary(stats: EngineStats) -> dict[str, Any]:
    lanes = {lane: {"running": c.running, "waiting": c.waiting} for lane, c in stats.lanes.items()}
    return {"running": stats.num_running, "waiting": stats.num_waiting, "lanes": lanes,
            "max_concurrency_soft": stats.max_concurrency_soft}


def block_entry(block: BlockInfo, block_size: int) -> dict[str, Any]:
    index = block.holders[0][1] if block.holders else None
    return {
        "id": block.block_id,
        "state": block.state,
        "ref": block.ref_cnt,
        "requests": [request_id for request_id, _ in block.holders],
        "session": block.session,
        "tokens": None if index is None else [index * block_size, (index + 1) * block_size],
        "last_used": block.last_used,
    }
