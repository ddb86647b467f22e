"""``slimkv bench cluster``: engine replicas behind one endpoint under multi-turn
long-document sessions, routed by slimkv's router and by Ray Serve's default (power of two
choices), with one engine as the reference, in one run.

Each variant is its own ``slimkv serve`` process (a fresh Ray cluster for the replicated
ones, so no cache survives from one variant to the next), driven by ``slimkv loadtest``'s
closed loop with its ``long-sessions`` workload and session ids sent as ``X-Session-ID``.
What matters is turns 2+ of each session: their prefix-cache hit rate (the ``cached_tokens``
each response reports over its prompt tokens) and their TTFT; also how often a turn landed on
the replica that served the session's previous turn, and the servers' own hit rate from
``/metrics``.
"""

from __future__ import annotations

import asyncio
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from slimkv.bench.live import ServerProcess
from slimkv.config import Config
from slimkv.loadtest.client import RequestResult
from slimkv.loadtest.report import summarize
from slimkv.loadtest.runner import LevelRun, RunSpec, run_level
from slimkv.loadtest.workloads import WorkloadSpec
from slimkv.workload import percentile

VARIANTS = {"single": (1, "slimkv"), "slimkv": (2, "slimkv"), "pow2": (2, "pow2")}
LABELS = {"single": "1 engine", "slimkv": "2 replicas, slimkv router",
          "pow2": "2 replicas, Ray default (pow2)"}


@dataclass(frozen=True, slots=True)
class ClusterBenchSpec:
    variants: tuple[str, ...] = ("single", "slimkv", "pow2")
    replicas: int = 2
    concurrency: int = 12
    duration: float = 150.0
    warmup: float = 15.0
    think_time: float = 2.0
    workload: WorkloadSpec = WorkloadSpec("long-sessions", context=2048, doc_tokens=1024,
                                          max_tokens=32)


def server_totals(url: str) -> dict[str, float]:
    """Prefix-cache totals summed over every replica, and the router's decisions."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    totals: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("slimkv:prefix_cache_hits_total", "slimkv:prefix_cache_queries_total"):
                totals[s.name.split(":")[1]] += s.value
            elif s.name == "slimkv:router_decisions_total":
                totals[f"router_{s.labels['reason']}"] += s.value
    return dict(totals)


def _ms(values: list[float], q: int) -> float | None:
    p = percentile(values, q)
    return None if p is None else round(1000 * p, 1)


def stickiness(results: list[RequestResult]) -> float | None:
    """Share of turns 2+ served by the replica that served the session's previous turn."""
    by_session: dict[str, list[RequestResult]] = defaultdict(list)
    for r in sorted(results, key=lambda r: r.start):
        if r.ok:
            by_session[r.session].append(r)
    pairs = [(a.replica, b.replica) for turns in by_session.values()
             for a, b in zip(turns, turns[1:]) if b.turn == a.turn + 1]
    return round(sum(a == b for a, b in pairs) / len(pairs), 4) if pairs else None


def summarize_variant(name: str, run: LevelRun, before: dict[str, float],
                      after: dict[str, float]) -> dict[str, Any]:
    done = [r for r in run.measured if r.ok]
    later = [r for r in done if r.turn >= 2]
    first = [r for r in done if r.turn == 1]
    prompt = sum(r.prompt_tokens or 0 for r in later)
    queries = after.get("prefix_cache_queries_total", 0) - before.get("prefix_cache_queries_total", 0)
    hits = after.get("prefix_cache_hits_total", 0) - before.get("prefix_cache_hits_total", 0)
    return {
        "variant": name, "label": LABELS[name],
        "turns_2plus": {
            "requests": len(later),
            "prefix_hit_rate": round(sum(r.cached_tokens or 0 for r in later) / prompt, 4)
            if prompt else None,
            "ttft_ms": {"p50": _ms([r.ttft for r in later], 50),
                        "p99": _ms([r.ttft for r in later], 99)},
            "same_replica_as_previous_turn": stickiness(run.results),
            "mean_prompt_tokens": round(prompt / len(later), 1) if later else None,
        },
        "turn_1": {"requests": len(first),
                   "ttft_ms": {"p50": _ms([r.ttft for r in first], 50),
                               "p99": _ms([r.ttft for r in first], 99)}},
        "server_prefix_hit_rate": round(hits / queries, 4) if queries else None,
        "requests_per_replica": dict(Counter(r.replica or "-" for r in done)),
        "router_decisions": {k.removeprefix("router_"): after[k] - before.get(k, 0)
                             for k in after if k.startswith("router_")},
        "overall": summarize(run),
    }


def variant_config(config: Config, name: str, spec: ClusterBenchSpec) -> Config:
    replicas, router = VARIANTS[name]
    replicas = spec.replicas if replicas > 1 else 1
    return config.replace("cluster", replicas=replicas, router=router)


def bench_cluster(config: Config, spec: ClusterBenchSpec) -> dict[str, Any]:
    from slimkv.bench.engine import machine_info

    runs = []
    for name in spec.variants:
        with ServerProcess(variant_config(config, name, spec), start_timeout=600) as server:
            run_spec = RunSpec(server.url, server.model_name(), spec.workload, spec.duration,
                               spec.warmup, extra_body={"ignore_eos": True},
                               session_header=True, think_time=spec.think_time)
            before = server_totals(server.url)
            run = asyncio.run(run_level(run_spec, spec.concurrency))
            after = server_totals(server.url)
        runs.append(summarize_variant(name, run, before, after))
        t = runs[-1]["turns_2plus"]
        print(f"{LABELS[name]:>32}: turns 2+ hit rate {t['prefix_hit_rate']}, TTFT P50 "
              f"{t['ttft_ms']['p50']} ms, P99 {t['ttft_ms']['p99']} ms "
              f"({t['requests']} turns)", flush=True)
    return {"machine": machine_info(), "model_dtype": config.model.dtype,
            "spec": {**asdict(spec), "workload": asdict(spec.workload)}, "runs": runs}


def plot_cluster(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    labels = [r["label"].replace(", ", "\n") for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    rates = [100 * (r["turns_2plus"]["prefix_hit_rate"] or 0) for r in runs]
    left.bar(labels, rates, color=["#888", "#2a7", "#c64"][:len(runs)])
    left.set_ylabel("prefix-cache hit rate, turns 2+ (%)")
    left.set_ylim(0, 100)
    for i, v in enumerate(rates):
        left.text(i, v + 1, f"{v:.1f}%", ha="center")
    xs = range(len(runs))
    p50 = [r["turns_2plus"]["ttft_ms"]["p50"] or 0 for r in runs]
    p99 = [r["turns_2plus"]["ttft_ms"]["p99"] or 0 for r in runs]
    right.bar([x - 0.2 for x in xs], p50, 0.4, label="P50")
    right.bar([x + 0.2 for x in xs], p99, 0.4, label="P99")
    right.set_xticks(list(xs), labels)
    right.set_ylabel("TTFT of turns 2+ (ms)")
    right.legend()
    w = result["spec"]["workload"]
    fig.suptitle(f"{result['spec']['concurrency']} users, {result['spec']['think_time']:g} s "
                 f"think time, long-document sessions "
                 f"({w['doc_tokens']}-token documents, {w['context']}-token context), "
                 f"{result['spec']['duration']:g} s each; {result['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_cluster_cli(bench: Any) -> None:
    from slimkv.cli import add_config_args

    p = bench.add_parser("cluster", help="replicas on Ray Serve: slimkv's router vs Ray's "
                         "default, one engine as reference, under long multi-turn sessions")
    add_config_args(p)
    p.add_argument("--variants", default="single,slimkv,pow2",
                   help=f"from {', '.join(VARIANTS)} (run in this order)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=12, help="closed-loop clients (users)")
    p.add_argument("--think-time", type=float, default=2.0,
                   help="mean seconds a user waits after each answer: without it a closed loop "
                   "hands a finished turn's slot straight back to the same replica")
    p.add_argument("--duration", type=float, default=150.0, help="seconds per variant")
    p.add_argument("--warmup", type=float, default=15.0, help="seconds per variant not measured")
    p.add_argument("--doc-tokens", type=int, default=1024)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/cluster/cluster.json", help="JSON to write")
    p.add_argument("--plot", default="bench/cluster/cluster.png", help="PNG to write")
    p.set_defaults(func=cmd_bench_cluster)


def cmd_bench_cluster(args: Any) -> int:
    import json

    from slimkv.cli import config_from_args

    variants = tuple(v for v in args.variants.split(",") if v)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        raise ValueError(f"--variants: unknown {unknown}; choose from {', '.join(VARIANTS)}")
    workload = WorkloadSpec("long-sessions", args.context, args.doc_tokens, args.max_tokens,
                            seed=args.seed)
    spec = ClusterBenchSpec(variants, args.replicas, args.concurrency, args.duration,
                            args.warmup, args.think_time, workload)
    result = bench_cluster(config_from_args(args), spec)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if args.plot:
        plot_cluster(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
