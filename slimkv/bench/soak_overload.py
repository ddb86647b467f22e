"""The soak's overload phase: twice the soft limit's worth of closed-loop sessions against
one ``slimkv serve`` process for a long time, its resident memory sampled throughout.

Each client runs 4-turn sessions over long documents, back to back, with no think time; a
429 is honoured (it waits ``Retry-After`` and sends the turn again). Every response must be
200 or 429 with ``Retry-After``; none 5xx, none cut off, none past its deadline (a hang).
When the time is up the clients finish their turn and stop, and the server's own
``/metrics`` must show an idle engine: nothing running or queued, no KV block in use.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from slimkv.bench.soak_client import Session, TurnResult, document, send_turn
from slimkv.bench.soak_server import SoakServer, metric_values
from slimkv.config import Config
from slimkv.workload import percentile

IDLE_METRICS = ("slimkv:num_requests_running", "slimkv:num_requests_waiting",
                "slimkv:kv_cache_blocks_used")


@dataclass(frozen=True, slots=True)
class OverloadSpec:
    soft_limit: int = 4            # kv_cache.max_concurrency_soft of the server
    max_queue: int = 2             # scheduler.max_queue: past it, 429
    queue_timeout_s: float = 30.0  # scheduler.queue_timeout_s: waited longer, 429
    duration_s: float = 600.0
    doc_tokens: int = 1536
    turns: int = 4
    max_tokens: int = 32
    turn_timeout_s: float = 180.0  # a turn not ended by then is a hang
    rss_every_s: float = 10.0
    rss_from_s: float = 120.0      # memory growth is judged from here to the end

    @property
    def clients(self) -> int:
        return 2 * self.soft_limit


def overload_config(config: Config, spec: OverloadSpec) -> Config:
    config = config.replace("kv_cache", max_concurrency_soft=spec.soft_limit)
    return config.replace("scheduler", max_queue=spec.max_queue,
                          queue_timeout_s=spec.queue_timeout_s)


async def _client(i: int, server: SoakServer, model: str, spec: OverloadSpec,
                  deadline: float, results: list[TurnResult]) -> None:
    timeout = httpx.Timeout(spec.turn_timeout_s + 10, connect=10)
    async with httpx.AsyncClient(timeout=timeout) as http:
        n = 0
        while time.monotonic() < deadline and n < 100_000:
            session, n = Session(f"c{i}-s{n}", document(1000 * i + n, spec.doc_tokens)), n + 1
            while session.turn <= spec.turns and time.monotonic() < deadline:
                messages = session.messages()
                r = await send_turn(http, server.url, model, messages, session.name,
                                    session.turn, spec.max_tokens, spec.turn_timeout_s)
                results.append(r)
                if r.ok:
                    session.answer(messages, r.text)
                elif r.outcome == "busy":
                    await asyncio.sleep(min(30.0, float(r.retry_after or 1)))
                else:
                    await asyncio.sleep(1.0)   # a failure: counted; do not spin on it


async def _sample_rss(server: SoakServer, spec: OverloadSpec, t0: float,
                      stop: asyncio.Event, out: list[tuple[float, int]],
                      kinds: list[dict[str, float]]) -> None:
    while not stop.is_set():
        out.append((round(time.monotonic() - t0, 1), server.rss_bytes()))
        kinds.append(server.memory_mb())
        try:
            await asyncio.wait_for(stop.wait(), spec.rss_every_s)
        except asyncio.TimeoutError:
            pass


def _idle(url: str, timeout_s: float = 60.0) -> dict[str, float]:
    """The engine's gauges once idle (or whatever they are when ``timeout_s`` ran out)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = metric_values(url)
        values = {k.split(":")[1]: m.get(k, -1.0) for k in IDLE_METRICS}
        if not any(values.values()) or time.monotonic() > deadline:
            return values
        time.sleep(0.5)


def rss_growth(samples: list[tuple[float, int]], from_s: float) -> dict[str, Any]:
    """Growth from the first samples at ``from_s`` (median of 3) to the last (median of 3)."""
    later = [rss for t, rss in samples if t >= from_s and rss > 0]
    if len(later) < 2:
        return {"from_s": from_s, "samples": len(later), "growth": None}
    base = sorted(later[:3])[len(later[:3]) // 2]
    end = sorted(later[-3:])[len(later[-3:]) // 2]
    return {"from_s": from_s, "samples": len(later), "base_mb": round(base / 2**20, 1),
            "end_mb": round(end / 2**20, 1), "max_mb": round(max(later) / 2**20, 1),
            "growth": round(end / base - 1, 4)}


def run_overload(config: Config, spec: OverloadSpec) -> dict[str, Any]:
    with SoakServer(overload_config(config, spec), start_timeout=600) as server:
        model = server.model_name()
        results: list[TurnResult] = []
        rss: list[tuple[float, int]] = []
        kinds: list[dict[str, float]] = []

        async def main() -> None:
            t0 = time.monotonic()
            stop = asyncio.Event()
            sampler = asyncio.create_task(_sample_rss(server, spec, t0, stop, rss, kinds))
            await asyncio.gather(*(_client(i, server, model, spec, t0 + spec.duration_s,
                                           results) for i in range(spec.clients)))
            stop.set()
            await sampler

        start = time.monotonic()
        asyncio.run(main())
        idle = _idle(server.url)
        alive = server.returncode is None
    out = summarize(results, rss, idle, alive, spec, start)
    out["rss_by_kind_mb"] = kinds
    return out


def summarize(results: list[TurnResult], rss: list[tuple[float, int]],
              idle: dict[str, float], alive: bool, spec: OverloadSpec,
              start: float) -> dict[str, Any]:
    outcomes = Counter(r.outcome for r in results)
    statuses = Counter(str(r.status) for r in results)
    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    timeline = [{"t": round(r.start - start, 2), "outcome": r.outcome,
                 "ttft": None if r.ttft is None else round(r.ttft, 3)} for r in results]
    return {
        "spec": {**asdict(spec), "clients": spec.clients},
        "requests": len(results), "outcomes": dict(outcomes), "statuses": dict(statuses),
        "busy_without_retry_after": sum(r.status == 429 and not r.retry_after for r in results),
        "server_errors_5xx": sum((r.status or 0) >= 500 for r in results),
        "hangs": outcomes.get("timeout", 0), "server_alive": alive,
        "ttft_s": {"p50": percentile(ttft, 50), "p90": percentile(ttft, 90),
                   "p99": percentile(ttft, 99)},
        "turns_per_s": round(len(ok) / max(1e-9, spec.duration_s), 3),
        "after": idle, "rss": rss_growth(rss, spec.rss_from_s),
        "rss_samples": [[t, round(b / 2**20, 1)] for t, b in rss], "timeline": timeline,
    }
