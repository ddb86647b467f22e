"""The KV cache state behind ``GET /v1/cache/state`` and the dashboard.

Everything here runs on the engine thread: :class:`CacheHistory` is a step hook of the
:class:`~slimkv.server.async_engine.AsyncEngine`, and :meth:`CacheHistory.snapshot` is
posted with ``AsyncEngine.call``, so it reads the pool between two steps and returns plain
data that the handler serialises. The schema is documented in the README ("Dashboard");
``SCHEMA_VERSION`` changes only when a field is removed or changes meaning.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from slimkv.engine import LLMEngine
from slimkv.kv.block_pool import Block
from slimkv.outputs import RequestOutput
from slimkv.stats import percentile

SCHEMA_VERSION = 1
WINDOW_S = 60
# Every state a block can be reported in. "staging" is reported when the KV scheme keeps a
# full-precision staging block per running sequence; the current schemes have none.
STATES = ("free", "in_use", "cached", "pinned", "staging")
COUNTERS = ("evictions", "preemptions", "prefix_queries", "prefix_hits")


class RecentCounts:
    """Per-second increments of monotonic engine counters over the last ``WINDOW_S`` s."""

    def __init__(self) -> None:
        self._last = dict.fromkeys(COUNTERS, 0)  # the engine's counters start at zero
        self._seconds: deque[tuple[int, dict[str, int]]] = deque()

    def record(self, now: float, totals: dict[str, int]) -> None:
        deltas = {name: totals[name] - self._last[name] for name in COUNTERS}
        self._last = totals
        second = int(now)
        if any(deltas.values()):
            if not self._seconds or self._seconds[-1][0] != second:
                self._seconds.append((second, dict.fromkeys(COUNTERS, 0)))
            for name, delta in deltas.items():
                self._seconds[-1][1][name] += delta
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

    def totals(self) -> dict[str, int]:
        return dict(self._last)


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

    def __call__(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        now = time.monotonic()
        self.counts.record(now, {
            "evictions": engine.pool.num_evictions,
            "preemptions": engine.scheduler.num_preemptions,
            "prefix_queries": engine.manager.num_prefix_queries,
            "prefix_hits": engine.manager.num_prefix_hits})
        for out in outputs:
            if out.ttft is not None:
                self.ttft.add(now, out.ttft)

    def snapshot(self, engine: LLMEngine, with_blocks: bool = True) -> dict[str, Any]:
        now = time.monotonic()
        blocks = block_states(engine)
        counts = dict.fromkeys(STATES, 0)
        for block in blocks:
            counts[block["state"]] += 1
        state = {
            "schema_version": SCHEMA_VERSION,
            "time": time.time(),
            "step": engine.num_steps,
            "model": engine.model_name,
            "pool": pool_summary(engine, blocks),
            "counts": counts,
            "requests": request_summary(engine),
            "memory": {**engine.memory_split(), "kv_bytes_per_token": engine.runner.bytes_per_token,
                       "k_dtype": engine.runner.k_dtype, "v_dtype": engine.runner.v_dtype},
            "prefix_cache": self._prefix_summary(now),
            "events": {"window_s": WINDOW_S,
                       **{f"{name}_total": self.counts.totals()[name]
                          for name in ("evictions", "preemptions")},
                       **{name: self.counts.series(now, name)
                          for name in ("evictions", "preemptions")}},
            "ttft": self.ttft.summary(now),
        }
        if with_blocks:
            state["blocks"] = blocks
        return state

    def _prefix_summary(self, now: float) -> dict[str, Any]:
        totals = self.counts.totals()
        recent_q = sum(self.counts.series(now, "prefix_queries"))
        recent_h = sum(self.counts.series(now, "prefix_hits"))
        return {"queries_total": totals["prefix_queries"], "hits_total": totals["prefix_hits"],
                "hit_rate": ratio(totals["prefix_hits"], totals["prefix_queries"]),
                "hit_rate_recent": ratio(recent_h, recent_q), "window_s": WINDOW_S}


def ratio(part: int, whole: int) -> float | None:
    return part / whole if whole else None


def pool_summary(engine: LLMEngine, blocks: list[dict[str, Any]]) -> dict[str, Any]:
    pool, kv = engine.pool, engine.config.kv_cache
    return {"num_blocks": pool.num_blocks, "block_size": engine.runner.cache.block_size,
            "num_free_blocks": pool.num_free_blocks, "usage": pool.usage,
            "watermark": kv.watermark, "watermark_alert": engine.scheduler.watermark_alert,
            "evict_policy": kv.evict_policy,
            "clock": max((b["last_used"] for b in blocks), default=0)}


def request_summary(engine: LLMEngine) -> dict[str, Any]:
    sched = engine.scheduler
    lanes = {lane: {"running": sched.num_running(lane), "waiting": sched.num_waiting(lane)}
             for lane in ("fast", "slow")}
    return {"running": sched.num_running(), "waiting": sched.num_waiting(), "lanes": lanes,
            "max_concurrency_soft": engine.config.kv_cache.max_concurrency_soft}


def block_states(engine: LLMEngine) -> list[dict[str, Any]]:
    """One entry per block of the pool, in block-id order."""
    holders: dict[int, list[tuple[str, int]]] = {}
    for seq in [*engine.scheduler.running, *engine.scheduler.waiting]:
        for index, block in enumerate(seq.blocks):
            holders.setdefault(block.block_id, []).append((seq.request_id, index))
    block_size = engine.runner.cache.block_size
    staged = staged_blocks(engine)
    return [block_entry(block, holders.get(block.block_id, []), block_size,
                        block.block_id in staged)
            for block in engine.pool.blocks]


def staged_blocks(engine: LLMEngine) -> set[int]:
    """Blocks whose tokens still live in their sequence's full-precision staging slot: the
    partly filled last block of a running sequence, when the KV scheme quantizes per block."""
    if engine.runner.cache.staging is None:
        return set()
    size = engine.runner.cache.block_size
    return {seq.blocks[seq.num_computed_tokens // size].block_id
            for seq in engine.scheduler.running
            if seq.num_computed_tokens % size and len(seq.blocks) > seq.num_computed_tokens // size}


def block_entry(block: Block, holders: list[tuple[str, int]], block_size: int,
                staged: bool) -> dict[str, Any]:
    index = holders[0][1] if holders else None
    return {
        "id": block.block_id,
        "state": "staging" if staged else block_state(block),
        "ref": block.ref_cnt,
        "requests": [request_id for request_id, _ in holders],
        "session": None if block.session_head is None else str(block.session_head),
        "tokens": None if index is None else [index * block_size, (index + 1) * block_size],
        "last_used": block.last_used,
    }


def block_state(block: Block) -> str:
    """Held by a live sequence first; a free block is a pinned session head, a prefix-cached
    (evictable) block, or empty."""
    if block.ref_cnt > 0:
        return "in_use"
    if block.session_head is not None:
        return "pinned"
    return "cached" if block.block_hash is not None else "free"
