"""One level of load on one engine: clients send turns, the engine steps, and what the
case measures is kept (running and queued sessions, KV in use, TTFT, TPOT, preemptions).

The engine is a :class:`~slimkv.simulate.engine.SimEngine` (simulated clock) or the real
engine behind :class:`~slimkv.simulate.calibrate.RealEngine` (wall clock); both expose
``now``, ``add_request``, ``step() -> (StepRecord, [Finished])``, ``idle_until`` and the
scheduler and pool.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field
from typing import Any

from slimkv.engine.sampling_params import SamplingParams
from slimkv.simulate.engine import Finished, StepRecord
from slimkv.simulate.workload import Client, SessionSpec, Turn


@dataclass(slots=True)
class LevelResult:
    concurrency: int
    start: float
    end: float
    warmup: float
    requests: list[tuple[Turn, Finished]] = field(default_factory=list)
    unserved: list[Turn] = field(default_factory=list)   # no first token when the window closed
    steps: list[StepRecord] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    usage: list[float] = field(default_factory=list)
    preemptions: int = 0

    def summary(self) -> dict[str, Any]:
        t0 = self.start + self.warmup
        done = [(t, f) for t, f in self.requests if t.sent >= t0]
        ttft = [f.first_token - t.sent for t, f in done]
        ttft += [self.end - t.sent for t in self.unserved if t.sent >= t0]
        tpot = [(f.end - f.first_token) / (f.num_output_tokens - 1)
                for _, f in done if f.num_output_tokens > 1]
        out_tokens = sum(f.num_output_tokens for _, f in done)
        decode = [s.duration for s in self.steps if s.is_decode]
        return {"concurrency": self.concurrency,
                "peak_running": max(self.running, default=0),
                "mean_running": round(statistics.fmean(self.running), 2) if self.running else 0,
                "peak_waiting": max(self.waiting, default=0),
                "peak_kv_usage": round(max(self.usage, default=0.0), 4),
                "preemptions": self.preemptions, "requests_done": len(done),
                "requests_unserved_at_end": sum(t.sent >= t0 for t in self.unserved),
                "ttft_s": percentiles(ttft), "tpot_s": percentiles(tpot),
                "decode_step_s": percentiles(decode),
                "out_tok_s": round(out_tokens / max(1e-9, self.end - t0), 2)}


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    v = sorted(values)
    pick = lambda q: v[min(len(v) - 1, int(q * len(v)))]  # noqa: E731
    return {"p50": round(pick(0.5), 4), "p99": round(pick(0.99), 4),
            "mean": round(statistics.fmean(v), 4)}


def run_level(engine: Any, spec: SessionSpec, concurrency: int, duration: float,
              warmup: float = 0.0, keep_steps: bool = False) -> LevelResult:
    """``concurrency`` clients for ``duration`` seconds of the engine's clock. Turns sent
    before ``warmup`` load the engine but are not measured. The engine is left with the
    level's leftovers: use a fresh engine per level."""
    start = engine.now
    clients = [Client.make(i, spec, start) for i in range(concurrency)]
    ready = [(c.ready_at, c.index) for c in clients]
    heapq.heapify(ready)
    inflight: dict[str, tuple[Turn, Client]] = {}
    result = LevelResult(concurrency, start, start + duration, warmup)
    while engine.now < result.end:
        while ready and ready[0][0] <= engine.now:
            client = clients[heapq.heappop(ready)[1]]
            turn = client.next_turn(engine.now)
            engine.add_request(turn.prompt, SamplingParams(max_tokens=turn.max_tokens,
                                                           ignore_eos=True),
                               turn.request_id, turn.session)
            inflight[turn.request_id] = (turn, client)
        if not engine.has_unfinished():
            engine.idle_until(min(ready[0][0] if ready else result.end, result.end))
            continue
        record, finished = engine.step()
        if keep_steps:
            result.steps.append(record)
        result.running.append(engine.scheduler.num_running())
        result.waiting.append(engine.scheduler.num_waiting())
        result.usage.append(engine.pool.usage)
        for f in finished:
            turn, client = inflight.pop(f.request_id)
            result.requests.append((turn, f))
            client.answered(f.token_ids, engine.now)
            heapq.heappush(ready, (client.ready_at, client.index))
    result.end = engine.now
    result.unserved = [t for rid, (t, _) in inflight.items()
                       if engine.requests[rid].first_token_time is None]
    result.preemptions = engine.scheduler.num_preemptions
    return result
