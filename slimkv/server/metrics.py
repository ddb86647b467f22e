"""Prometheus metrics, named after vLLM's (``vllm:`` becomes ``slimkv:``).

The engine thread calls :meth:`ServerMetrics.update` after every step with the engine's
:class:`~slimkv.engine.engine_stats.EngineStats` and the increments of its monotonic counters
(:class:`CounterDeltas`), so gauges show the state the engine itself
saw and no engine structure is read from another thread. Each server gets its own
registry, so several servers can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info,
                               generate_latest)

from slimkv.engine.engine_stats import EngineStats
from slimkv.engine.outputs import RequestOutput
from slimkv.server.offload_metrics import OffloadCollector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class CounterDeltas:
    """Increments of :meth:`EngineStats.counters` since the previous call (the first call
    counts from zero); names that did not move are left out."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def __call__(self, stats: EngineStats) -> dict[str, int]:
        totals = stats.counters()
        deltas = {name: n - self._last.get(name, 0) for name, n in totals.items()
                  if n != self._last.get(name, 0)}
        self._last = totals
        return deltas


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        r = self.registry

        def gauge(name: str, doc: str, extra: tuple[str, ...] = ()) -> Gauge:
            return Gauge(f"slimkv:{name}", doc, labels + list(extra), registry=r)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"slimkv:{name}", doc, labels + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"slimkv:{name}", doc, labels, buckets=buckets, registry=r)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests queued for admission.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV blocks held by live requests (0..1).")
        self.blocks_total = gauge("kv_cache_blocks_total", "Blocks in the preallocated KV pool.")
        self.blocks_used = gauge("kv_cache_blocks_used", "KV blocks held by live requests.")
        self.watermark_alert = gauge("kv_cache_watermark_alert",
                                     "1 while KV usage is over the watermark and admission waits.")
        self.watermark = gauge("kv_cache_watermark", "The configured KV watermark (0..1).")
        self.memory = gauge("memory_bytes", "Memory by component.", ("component",))
        self.kv_info = Info("slimkv:kv_cache_dtype", "KV storage format and bytes per token.",
                            labels, registry=r)
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (recompute).")
        self.evictions = counter("kv_cache_evictions", "Cached KV blocks evicted for reuse.")
        self.attention_path = counter("attention_path", "Attention calls per kernel path.", ("path",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of requests that started.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.success = counter("request_success", "Finished requests.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between two tokens of a request.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    REQUEST_BUCKETS)
        self.offload = OffloadCollector(model_name)
        r.register(self.offload)
        # Engine counters exported as they move (see EngineStats.counters).
        self._engine_counters = {"prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                        "preemptions": self.preemptions, "evictions": self.evictions}

    def describe_engine(self, stats: EngineStats) -> None:
        """The static facts: pool size, watermark, KV format, memory split (the activation
        share is the peak the engine measured at start-up)."""
        m = self.model_name
        for component, nbytes in stats.memory.items():
            self.memory.labels(m, component).set(nbytes)
        self.blocks_total.labels(m).set(stats.num_blocks)
        self.watermark.labels(m).set(stats.watermark)
        self.kv_info.labels(m).info({
            "k_dtype": stats.k_dtype, "v_dtype": stats.v_dtype,
            "bytes_per_token": str(stats.bytes_per_token), "block_size": str(stats.block_size)})
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                       self.e2e, self.queue_time, *self._engine_counters.values()):
            metric.labels(m)  # export zeros before the first request
        for reason in ("stop", "length", "abort"):
            self.success.labels(m, reason)
        self.update(stats, {}, [])

    def update(self, stats: EngineStats, deltas: dict[str, int],
               outputs: list[RequestOutput]) -> None:
        """Called by the engine thread after each step (or abort)."""
        m = self.model_name
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.usage)
        self.blocks_used.labels(m).set(stats.num_blocks_used)
        self.watermark_alert.labels(m).set(int(stats.watermark_alert))
        self.offload.update(stats.offload)
        for name, delta in deltas.items():
            if name.startswith("path:"):
                self.attention_path.labels(m, name.removeprefix("path:")).inc(delta)
            elif name in self._engine_counters:
                self._engine_counters[name].labels(m).inc(delta)
        for out in outputs:
            self._record_output(out)

    def record_aborts(self, count: int) -> None:
        if count:
            self.success.labels(self.model_name, "abort").inc(count)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)

    def _record_output(self, out: RequestOutput) -> None:
        m = self.model_name
        self.generation_tokens.labels(m).inc(len(out.new_token_ids))
        if out.ttft is not None:
            self.ttft.labels(m).observe(out.ttft)
            self.prompt_tokens.labels(m).inc(out.num_prompt_tokens)
        if out.queue_time is not None:
            self.queue_time.labels(m).observe(out.queue_time)
        if out.itl is not None:
            self.itl.labels(m).observe(out.itl)
        if out.finished:
            self.e2e.labels(m).observe(out.e2e or 0.0)
            self.success.labels(m, out.finish_reason or "unknown").inc()
