"""N replicas behind the scale-out router, at 1,000-10,000 sessions.

Each replica is a :class:`~slimkv.simulate.engine.SimEngine` on its own clock; every turn
is routed by :func:`slimkv.cluster.policy.route` (the function the Ray Serve router calls)
from the replicas' loads at the moment it is sent: sessions go home by rendezvous hashing
and yield to load or KV pressure. Events run in time order: a client's next turn, or the
step of the replica whose clock is furthest behind.
"""

from __future__ import annotations

import gc
import heapq
import math
import sys
import time
from typing import Any

from slimkv.cluster.config import ClusterConfig
from slimkv.cluster.policy import Balance, PrefixIndex, ReplicaLoad, RouteKeys, route
from slimkv.engine.sampling_params import SamplingParams
from slimkv.simulate.card import Card
from slimkv.simulate.run import percentiles
from slimkv.simulate.workload import Client, SessionSpec

TTFT_SLO_S = 5.0   # a fleet "serves" a load when P99 TTFT stays under this


def run_fleet(card: Card, num_replicas: int, spec: SessionSpec, num_sessions: int,
              duration: float, warmup: float) -> dict[str, Any]:
    """``num_sessions`` users (think time ``spec.think_time``) on ``num_replicas`` cards."""
    wall = time.monotonic()
    engines = [card.engine() for _ in range(num_replicas)]
    names = [f"r{i}" for i in range(num_replicas)]
    balance, index = Balance.from_config(ClusterConfig()), PrefixIndex()
    clients = [Client.make(i, spec) for i in range(num_sessions)]
    ready = [(c.ready_at, c.index) for c in clients]
    heapq.heapify(ready)
    busy: list[tuple[float, int]] = []
    inflight: dict[str, tuple[Any, Client]] = {}
    ttft, tpot, reasons, peak_running = [], [], {}, [0] * num_replicas
    # A replica's load changes only when it steps or takes a request: kept per replica,
    # not rebuilt for every turn (N x turns at 10,000 sessions).
    loads = [_load(n, e) for n, e in zip(names, engines)]
    gc.collect()
    gc.freeze()     # the pools' blocks live for the whole run: keep them out of GC scans
    next_report = 60.0
    while True:
        t_client = ready[0][0] if ready else math.inf
        t_step = busy[0][0] if busy else math.inf
        if min(t_client, t_step) >= duration:
            break
        if min(t_client, t_step) >= next_report:
            print(f"    {num_sessions} sessions on {num_replicas} cards: {next_report:.0f} s "
                  f"simulated, {time.monotonic() - wall:.0f} s wall", file=sys.stderr, flush=True)
            next_report += 60.0
        if t_client <= t_step:
            client = clients[heapq.heappop(ready)[1]]
            turn = client.next_turn(t_client)
            decision = route(RouteKeys(turn.session), loads, index, balance)
            reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
            r = int(decision.replica[1:])
            engine = engines[r]
            if not engine.has_unfinished():
                engine.idle_until(t_client)
                heapq.heappush(busy, (engine.now, r))
            engine.add_request(turn.prompt, SamplingParams(max_tokens=turn.max_tokens,
                                                           ignore_eos=True),
                               turn.request_id, turn.session)
            inflight[turn.request_id] = (turn, client)
            loads[r] = _load(names[r], engine)
            continue
        _, r = heapq.heappop(busy)
        engine = engines[r]
        _, finished = engine.step()
        peak_running[r] = max(peak_running[r], engine.scheduler.num_running())
        loads[r] = _load(names[r], engine)
        for f in finished:
            turn, client = inflight.pop(f.request_id)
            if turn.sent >= warmup:
                ttft.append(f.first_token - turn.sent)
                if f.num_output_tokens > 1:
                    tpot.append((f.end - f.first_token) / (f.num_output_tokens - 1))
            client.answered(f.token_ids, engine.now)
            heapq.heappush(ready, (client.ready_at, client.index))
        if engine.has_unfinished():
            heapq.heappush(busy, (engine.now, r))
    gc.unfreeze()
    unserved = [duration - turn.sent for turn, _ in inflight.values()
                if turn.sent >= warmup and _first_token(engines, turn.request_id) is None]
    ttft_all = ttft + unserved
    return {"replicas": num_replicas, "sessions": num_sessions,
            "ttft_s": percentiles(ttft_all), "tpot_s": percentiles(tpot),
            "turns_done": len(ttft), "unserved_at_end": len(unserved),
            "peak_running_per_replica": max(peak_running),
            "preemptions": sum(e.scheduler.num_preemptions for e in engines),
            "route_reasons": reasons, "wall_s": round(time.monotonic() - wall, 1)}


def _load(name: str, engine) -> ReplicaLoad:
    scheduler = engine.scheduler
    return ReplicaLoad(name, scheduler.num_running() + scheduler.num_waiting(), engine.pool.usage,
                       scheduler.watermark_alert)


def _first_token(engines, request_id: str) -> float | None:
    for e in engines:
        seq = e.requests.get(request_id)
        if seq is not None:
            return seq.first_token_time
    return None


def meets_slo(result: dict[str, Any]) -> bool:
    p99 = result["ttft_s"]["p99"]
    return p99 is not None and p99 <= TTFT_SLO_S


def cards_needed(card: Card, spec: SessionSpec, num_sessions: int, duration: float,
                 warmup: float, low: int, high: int) -> tuple[int, list[dict[str, Any]]]:
    """The fewest replicas in ``[low, high]`` whose P99 TTFT meets the SLO (bisection;
    more cards never make it worse here), with every run tried."""
    tried = []
    while low < high:
        mid = (low + high) // 2
        result = run_fleet(card, mid, spec, num_sessions, duration, warmup)
        tried.append(result)
        if meets_slo(result):
            high = mid
        else:
            low = mid + 1
    return low, tried


def fleet_rows(model: str, device_name: str, dtypes: tuple[str, ...],
               sessions: tuple[int, ...], think_time: float, duration: float,
               warmup: float, cards: int | None = None,
               cards_range: tuple[int, int] | None = None) -> dict[str, Any]:
    """Cards needed per KV dtype: bisection at the smallest load, then each larger load
    run once at the same sessions per card, so the 10,000-session run is timed as it is
    used (``cards_range``: the bisection's bounds, default 1/400 to 1/20 of the load). With
    ``cards`` every load runs once on that many cards (no bisection): a long
    sweep split into pieces, merged by :func:`merge_rows`."""
    from slimkv.simulate.card import Variant
    from slimkv.simulate.costs import device

    spec = SessionSpec(4096, 2048, 256, think_time=think_time)
    rows = []
    for dtype in dtypes:
        card = Card.build(model, device(device_name), Variant(dtype), 4096)
        todo = sorted(sessions)
        if cards is None:
            first = todo.pop(0)
            low, high = cards_range or (max(1, first // 400), max(2, first // 20))
            need, tried = cards_needed(card, spec, first, duration, warmup, low, high)
            result = next((t for t in tried if t["replicas"] == need), None) or \
                run_fleet(card, need, spec, first, duration, warmup)
            rows.append(_row(card, first, need, result, tried))
        for n in todo:
            scaled = cards or math.ceil(rows[-1]["cards"] * n / rows[-1]["sessions"])
            rows.append(_row(card, n, scaled, run_fleet(card, scaled, spec, n, duration,
                                                        warmup), []))
    return {"model": model, "device": device_name, "think_time": think_time,
            "duration": duration, "warmup": warmup, "slo_s": TTFT_SLO_S, "rows": rows}


def _row(card: Card, sessions: int, cards: int, result: dict[str, Any],
         tried: list[dict[str, Any]]) -> dict[str, Any]:
    print(f"  {card.variant.name}: {sessions} sessions on {cards} cards: P99 TTFT "
          f"{result['ttft_s']['p99']} s, wall {result['wall_s']} s", flush=True)
    return {"variant": card.variant.name, "sessions": sessions, "cards": cards,
            "meets_slo": meets_slo(result), "result": result,
            "bisection": [{"cards": t["replicas"], "p99_ttft_s": t["ttft_s"]["p99"],
                           "wall_s": t["wall_s"]} for t in tried]}


def merge_rows(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """``new``'s rows over ``old``'s (a row is one variant, load and card count), when
    both ran the same workload; sorted by variant, load, cards."""
    keys = ("model", "device", "think_time", "duration", "warmup", "slo_s")
    if old is None or any(old.get(k) != new[k] for k in keys):
        return new
    key = lambda r: (r["variant"], r["sessions"], r["cards"])  # noqa: E731
    rows = {key(r): r for r in old["rows"]} | {key(r): r for r in new["rows"]}
    return {**new, "rows": [rows[k] for k in sorted(rows)]}
