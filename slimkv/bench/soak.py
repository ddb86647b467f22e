"""``slimkv bench soak``: overload, memory over time, replica kills and a crash, each with
a verdict (docs/soak.md).

Phases (``--phases``, in this order; every one bounded in time and count, loopback only):

- ``overload`` (:mod:`slimkv.bench.soak_overload`): twice the soft limit's worth of sessions
  for ``--overload-s`` against one server; verdicts ``overload_only_429`` (every response
  200 or 429 with ``Retry-After``, no 5xx, no hang), ``no_leaked_blocks`` (the server's
  /metrics after it: nothing running or queued, no KV block used) and ``rss_flat`` (the
  server's resident memory, sampled every ``--rss-every-s``, grows < 5% from
  ``--rss-from-s`` to the end).
- ``kills`` (:mod:`slimkv.bench.soak_kills`): two replicas on Ray, one shared disk tier, a
  replica killed ``--kills`` times mid-stream; ``replica_kill_all_answered`` and
  ``reroute_reloads_kv``, with the warm, re-route and recompute TTFTs.
- ``crash`` (:mod:`slimkv.bench.soak_crash`): ``kill -9`` while the disk tier writes, a
  restart over the directory; ``crash_no_bad_chunk_loaded`` and ``crash_outputs_equal``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from slimkv.bench.soak_crash import CrashSpec, run_crash
from slimkv.bench.soak_kills import KillSpec, run_kills
from slimkv.bench.soak_overload import OverloadSpec, run_overload
from slimkv.config import Config

PHASES = ("overload", "kills", "crash")
RSS_LIMIT = 0.05
BLOCKS = 16   # offload counters count 16 blocks per chunk


def overload_verdicts(o: dict[str, Any]) -> dict[str, bool]:
    clean = set(o["outcomes"]) <= {"ok", "busy"}
    return {"overload_only_429": bool(o["requests"]) and clean and o["server_alive"]
            and o["server_errors_5xx"] == 0 and o["hangs"] == 0
            and o["busy_without_retry_after"] == 0,
            "no_leaked_blocks": all(v == 0 for v in o["after"].values()),
            "rss_flat": o["rss"]["growth"] is not None and o["rss"]["growth"] < RSS_LIMIT}


def kill_verdicts(k: dict[str, Any]) -> dict[str, bool]:
    complete = k["kills"] == k["spec"]["kills"] and k["errors"] == 0
    return {"replica_kill_all_answered": complete and k["cut_clean"] and k["all_served"],
            "reroute_reloads_kv": complete and k["reroutes"] == k["kills"]
            and k["reroutes_reloaded"]}


def crash_verdicts(c: dict[str, Any]) -> dict[str, bool]:
    damaged = len(c["damaged_on_purpose"])
    detected = c["corrupt_blocks_after_replay"]
    return {"crash_no_bad_chunk_loaded": c["audit_after_kill"]["bad"] == 0
            and c["tmp_files_after_restart"] == 0
            and (damaged == 0 or c["corrupt_blocks_at_start"] >= BLOCKS)   # the truncated one
            and detected <= BLOCKS * damaged
            and c["turns_equal"] == c["turns_compared"],
            "crash_outputs_equal": c["turns_compared"] > 0
            and c["turns_equal"] == c["turns_compared"]}


VERDICTS = {"overload": ("overload_only_429", "no_leaked_blocks", "rss_flat"),
            "kills": ("replica_kill_all_answered", "reroute_reloads_kv"),
            "crash": ("crash_no_bad_chunk_loaded", "crash_outputs_equal")}


def _phase(phase: str, config: Config, overload: OverloadSpec, kills: KillSpec,
           crash: CrashSpec, work: str) -> tuple[dict[str, Any], dict[str, bool]]:
    if phase == "overload":
        out = run_overload(config, overload)
        return out, overload_verdicts(out)
    if phase == "kills":
        out = run_kills(config, kills, str(Path(work) / "shared-tier"))
        return out, kill_verdicts(out)
    out = run_crash(config, crash, str(Path(work) / "crash"))
    return out, crash_verdicts(out)


def run_soak(config: Config, phases: tuple[str, ...], overload: OverloadSpec,
             kills: KillSpec, crash: CrashSpec, workdir: str | None = None,
             save: Callable[[dict[str, Any]], None] = lambda result: None) -> dict[str, Any]:
    """Every phase in turn; ``save`` gets the result after each (a phase that breaks is
    recorded with its traceback and its verdicts missed; the next one still runs)."""
    from slimkv.bench.engine import machine_info

    result: dict[str, Any] = {"machine": machine_info(), "phases": list(phases),
                              "verdicts": {}}
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="slimkv-soak-", dir=workdir) as work:
        for phase in phases:
            t = time.monotonic()
            print(f"soak: {phase} ...", flush=True)
            try:
                result[phase], verdicts = _phase(phase, config, overload, kills, crash, work)
            except Exception:
                result[phase] = {"error": traceback.format_exc()}
                verdicts = dict.fromkeys(VERDICTS[phase], False)
                print(result[phase]["error"], flush=True)
            result["verdicts"] |= verdicts
            result["seconds"] = round(time.monotonic() - start, 1)
            save(result)
            print(f"soak: {phase} done in {time.monotonic() - t:.0f} s: " + ", ".join(
                f"{k}={v}" for k, v in result["verdicts"].items()), flush=True)
    return result


def add_soak_cli(bench: Any) -> None:
    from slimkv.cli import add_config_args

    p = bench.add_parser("soak", help="overload, memory, replica kills and a crash: verdicts")
    add_config_args(p)
    o, k, c = OverloadSpec(), KillSpec(), CrashSpec()
    p.add_argument("--phases", default=",".join(PHASES), help=f"from {', '.join(PHASES)}")
    p.add_argument("--overload-s", type=float, default=o.duration_s)
    p.add_argument("--soft-limit", type=int, default=o.soft_limit,
                   help="the server's kv_cache.max_concurrency_soft; 2x this many clients")
    p.add_argument("--max-queue", type=int, default=o.max_queue, help="scheduler.max_queue")
    p.add_argument("--doc-tokens", type=int, default=o.doc_tokens)
    p.add_argument("--turns", type=int, default=o.turns, help="turns per overload session")
    p.add_argument("--rss-every-s", type=float, default=o.rss_every_s)
    p.add_argument("--rss-from-s", type=float, default=o.rss_from_s)
    p.add_argument("--kills", type=int, default=k.kills)
    p.add_argument("--crash-sessions", type=int, default=c.sessions)
    p.add_argument("--workdir", help="where the temporary tier directories go")
    p.add_argument("--out", default="bench/soak/soak.json", help="JSON to write")
    p.add_argument("--plot", default="bench/soak/soak.png", help="PNG to write ('' for none)")
    p.set_defaults(func=cmd_bench_soak)


def cmd_bench_soak(args: argparse.Namespace) -> int:
    from slimkv.bench.soak_plot import plot_soak
    from slimkv.cli import config_from_args

    phases = tuple(x for x in args.phases.split(",") if x)
    if not phases or set(phases) - set(PHASES):
        raise ValueError(f"--phases: choose from {', '.join(PHASES)}")
    overload = OverloadSpec(soft_limit=args.soft_limit, max_queue=args.max_queue,
                            duration_s=args.overload_s, doc_tokens=args.doc_tokens,
                            turns=args.turns, rss_every_s=args.rss_every_s,
                            rss_from_s=args.rss_from_s)
    kills = KillSpec(kills=args.kills, doc_tokens=args.doc_tokens)
    crash = CrashSpec(sessions=args.crash_sessions, doc_tokens=args.doc_tokens)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(result: dict[str, Any]) -> None:
        out.write_text(json.dumps(result, indent=2) + "\n")

    result = run_soak(config_from_args(args), phases, overload, kills, crash, args.workdir,
                      save)
    print(f"wrote {out}")
    if args.plot:
        plot_soak(result, args.plot)
        print(f"wrote {args.plot}")
    failed = [name for name, ok in result["verdicts"].items() if not ok]
    print("verdicts: " + ("all met" if not failed else f"missed: {', '.join(failed)}"))
    return 0 if not failed else 1
