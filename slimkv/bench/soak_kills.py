"""The soak's replica-kill phase: two engine replicas on a real local Ray cluster (in this
process, like the cluster tests), one shared disk KV tier, and a replica killed with
``ray.kill`` mid-stream, again and again.

Each round waits for two live replicas, then picks a *victim* and a *survivor*, a session
homed on each (the routing policy, run here as a pure function, says where a session
lives). The victim's session takes two turns (the second, prefix-cached, is the **warm**
TTFT) and its third streams while the survivor's session streams too; at the victim's
first token the victim is killed. Its client must get a complete answer or a clean SSE
error event; it sends the turn again, which the ingress routes to the survivor: the
**re-route** TTFT, with the history loaded from the tier the victim wrote (its
``cached_tokens`` and the survivor's disk ``loaded_blocks``). The same prompt with a salted
document (nothing cached anywhere) gives the **recompute** TTFT. Then the session's next
turn must be served, and Serve brings a fresh replica up for the next round.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from slimkv.bench.live import free_port
from slimkv.bench.soak_client import Session, TurnResult, document, send_turn
from slimkv.config import Config
from slimkv.workload import percentile

LOADED = "slimkv:kv_offload_loaded_blocks_total"


@dataclass(frozen=True, slots=True)
class KillSpec:
    kills: int = 5
    doc_tokens: int = 1536
    max_tokens: int = 16            # the measured turns
    stream_tokens: int = 160        # the turn the kill cuts
    turn_timeout_s: float = 180.0
    restart_timeout_s: float = 300.0


def _replicas(url: str) -> list[str]:
    try:
        state = httpx.get(f"{url}/v1/cache/state?blocks=false", timeout=30).json()
        return sorted(r["replica"] for r in state["replicas"])
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and labels.items() <= s.labels.items())


def _homed(config: Config, names: list[str], target: str, prefix: str) -> str:
    from slimkv.cluster.policy import Balance, PrefixIndex, ReplicaLoad, RouteKeys, route

    balance = Balance.from_config(config.cluster)
    for i in range(1000):
        loads = [ReplicaLoad(n) for n in names]
        if route(RouteKeys(f"{prefix}-{i}"), loads, PrefixIndex(), balance).replica == target:
            return f"{prefix}-{i}"
    raise RuntimeError("no session id routes to the replica")


def _kill(name: str) -> None:
    import ray

    ray.kill(ray.get_actor(f"SERVE_REPLICA::slimkv#EngineReplica#{name}", namespace="serve"))


async def _round(k: int, url: str, model: str, config: Config, spec: KillSpec,
                 names: list[str]) -> dict[str, Any]:
    victim, survivor = names[k % 2], names[1 - k % 2]
    timeout = httpx.Timeout(spec.turn_timeout_s + 10, connect=10)
    out: dict[str, Any] = {"round": k, "victim": victim, "survivor": survivor}
    async with httpx.AsyncClient(timeout=timeout) as http:
        async def turn(session: Session, max_tokens: int, first: asyncio.Event | None = None,
                       **fields: Any) -> tuple[list[dict], TurnResult]:
            messages = session.messages()
            return messages, await send_turn(http, url, model, messages, session.name,
                                             session.turn, max_tokens, spec.turn_timeout_s,
                                             first, **fields)

        mine = Session(_homed(config, names, victim, f"k{k}-v"), document(5000 + k, spec.doc_tokens))
        other = Session(_homed(config, names, survivor, f"k{k}-o"),
                        document(6000 + k, spec.doc_tokens))
        for name in ("turn1", "warm"):
            messages, r = await turn(mine, spec.max_tokens)
            out[name] = _brief(r)
            if not r.ok or r.replica != victim:
                out["error"] = f"{name} not served by the victim: {r.outcome} on {r.replica}"
                return out
            mine.answer(messages, r.text)
        await asyncio.sleep(1.0)           # the write-through queue drains (a few chunks)
        loaded_before = _metric(url, LOADED, replica=survivor, tier="disk")
        first = asyncio.Event()
        cut_messages = mine.messages()
        cut = asyncio.create_task(turn(mine, spec.stream_tokens, first, ignore_eos=True))
        bystander = asyncio.create_task(turn(other, spec.stream_tokens // 2, ignore_eos=True))
        waiter = asyncio.create_task(first.wait())
        await asyncio.wait({waiter, cut}, timeout=spec.turn_timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        if not first.is_set():
            out["error"] = "the cut turn produced no token"
            return out
        _kill(victim)
        (_, cut_r), (_, by_r) = await cut, await bystander
        out["cut"], out["bystander"] = _brief(cut_r), _brief(by_r)
        if cut_r.ok:                        # finished before the kill took effect
            mine.answer(cut_messages, cut_r.text)
        messages, again = await turn(mine, spec.max_tokens)
        out["reroute"] = _brief(again)
        out["reroute_loaded_blocks"] = (_metric(url, LOADED, replica=survivor, tier="disk")
                                        - loaded_before)
        if again.ok:
            mine.answer(messages, again.text)
        salted = [{**messages[0], "content": f"[cold {k}] " + messages[0]["content"]},
                  *messages[1:]]
        cold = await send_turn(http, url, model, salted, f"cold-{k}", 1, 1, spec.turn_timeout_s)
        out["recompute"] = _brief(cold)
        messages, nxt = await turn(mine, spec.max_tokens)
        out["next"] = _brief(nxt)
    return out


def _brief(r: TurnResult) -> dict[str, Any]:
    return {"outcome": r.outcome, "status": r.status, "replica": r.replica,
            "ttft_s": None if r.ttft is None else round(r.ttft, 4),
            "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
            "error_code": r.error_code}


def _wait_for_two(url: str, gone: set[str], timeout_s: float) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        names = _replicas(url)
        if len(names) == 2 and not gone & set(names):
            return names
        time.sleep(1.0)
    return _replicas(url)


def run_kills(config: Config, spec: KillSpec, disk_path: str) -> dict[str, Any]:
    from slimkv.cluster.launch import deploy, shutdown

    config = (config.replace("kv_cache", offload={"host_gb": 0.0, "disk_path": disk_path,
                                                  "disk_gb": 4.0})
              .replace("cluster", replicas=2, stats_period_s=0.5))
    start = time.monotonic()
    for attempt in range(3):      # a free port can be taken before Serve binds it
        config = config.replace("server", host="127.0.0.1", port=free_port(), api_key=None)
        try:
            url = deploy(config)
            break
        except Exception:
            shutdown()
            if attempt == 2:
                raise
    rounds, gone, waits = [], set(), []
    try:
        model = httpx.get(f"{url}/v1/models", timeout=60).json()["data"][0]["id"]
        for k in range(spec.kills):
            t = time.monotonic()
            names = _wait_for_two(url, gone, spec.restart_timeout_s)
            waits.append(round(time.monotonic() - t, 1))
            if len(names) != 2:
                rounds.append({"round": k, "error": f"replicas up: {names}"})
                break
            try:
                rounds.append(asyncio.run(_round(k, url, model, config, spec, names)))
            except Exception as exc:   # a round that breaks is reported, not fatal
                rounds.append({"round": k, "error": f"{type(exc).__name__}: {exc}"})
            gone.add(names[k % 2])
    finally:
        shutdown()
    return summarize(rounds, waits, spec, time.monotonic() - start)


def summarize(rounds: list[dict], waits: list[float], spec: KillSpec,
              seconds: float) -> dict[str, Any]:
    done = [r for r in rounds if "error" not in r]

    def ttfts(key: str) -> list[float]:
        return [r[key]["ttft_s"] for r in done if r[key]["ttft_s"] is not None]

    def p50(values: list[float]) -> float | None:
        v = percentile(values, 50)
        return None if v is None else round(v, 4)

    clean = all(r["cut"]["outcome"] in ("ok", "sse_error") for r in done)
    served = all(r["reroute"]["outcome"] == "ok" and r["next"]["outcome"] == "ok"
                 and r["bystander"]["outcome"] == "ok" for r in done)
    reloads = [r for r in done if r["reroute"]["replica"] == r["survivor"]]
    reloaded = all((r["reroute"]["cached_tokens"] or 0) >= 256
                   and r["reroute_loaded_blocks"] >= 16 for r in reloads)
    return {"spec": asdict(spec), "seconds": round(seconds, 1), "rounds": rounds,
            "replica_wait_s": waits, "kills": len(done), "errors": len(rounds) - len(done),
            "cut_clean": clean, "all_served": served,
            "reroutes": len(reloads), "reroutes_reloaded": reloaded and bool(reloads),
            "ttft_p50_s": {"warm": p50(ttfts("warm")), "reroute_reload": p50(ttfts("reroute")),
                           "recompute": p50(ttfts("recompute"))},
            "reroute_cached_share": p50([r["reroute"]["cached_tokens"] / r["reroute"]["prompt_tokens"]
                                         for r in reloads if r["reroute"]["prompt_tokens"]])}
