"""``slimkv loadtest``: sweep concurrency levels against any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from slimkv.loadtest.client import RequestResult
from slimkv.loadtest.report import format_table, plot_levels, summarize
from slimkv.loadtest.runner import RunSpec, run_level
from slimkv.loadtest.workloads import WORKLOADS, WorkloadSpec


class Progress:
    """A tqdm bar over one level's window, with completed requests and errors."""

    def __init__(self, concurrency: int, duration: float, enabled: bool = True) -> None:
        self.bar = tqdm(total=round(duration), desc=f"c={concurrency:<3}", unit="s",
                        disable=not enabled, leave=False,
                        bar_format="{desc} {bar} {n}/{total}s{postfix}")
        self.start = time.monotonic()
        self.done = 0
        self.errors = 0

    def __call__(self, result: RequestResult) -> None:
        self.done += result.ok
        self.errors += result.error is not None
        self.bar.n = min(self.bar.total, round(time.monotonic() - self.start))
        self.bar.set_postfix_str(f"done={self.done} errors={self.errors}")

    def close(self) -> None:
        self.bar.close()


def sweep(spec: RunSpec, levels: list[int], progress: bool = True) -> list[dict[str, Any]]:
    summaries = []
    for concurrency in levels:
        bar = Progress(concurrency, spec.duration, progress)
        run = asyncio.run(run_level(spec, concurrency, bar))
        bar.close()
        summaries.append(summarize(run))
    return summaries


def _levels(text: str) -> list[int]:
    levels = [int(x) for x in text.split(",") if x]
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be positive integers")
    return levels


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="closed-loop streaming load test of an OpenAI-compatible server")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", required=True, help="model name the server serves")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    p.add_argument("--concurrency", type=_levels, default=[8, 16, 24, 32, 48])
    p.add_argument("--workload", choices=WORKLOADS, default="long-sessions")
    p.add_argument("--duration", type=float, default=60.0, help="seconds per level")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds per level not measured")
    p.add_argument("--context", type=int, default=2048, help="token budget of a long session")
    p.add_argument("--doc-tokens", type=int, default=1024, help="document slice a session opens with")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per long-session turn")
    p.add_argument("--chat-max-tokens", type=int, default=32)
    p.add_argument("--ignore-eos", action="store_true",
                   help="send ignore_eos (vLLM/slimkv/llama.cpp) so every turn generates max_tokens")
    p.add_argument("--session-header", action="store_true",
                   help="send each turn's session id as X-Session-ID (slimkv: pins the session's "
                   "head in the cache; a cluster routes the session to one replica)")
    p.add_argument("--think-time", type=float, default=0.0,
                   help="mean seconds a client waits after each answer (uniform 0.5-1.5x)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--max-requests", type=int, default=100_000, help="cap per level")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", dest="json_out", help="write the results as JSON here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_loadtest)


def cmd_loadtest(args: argparse.Namespace) -> int:
    workload = WorkloadSpec(args.workload, args.context, args.doc_tokens, args.max_tokens,
                            args.chat_max_tokens, args.seed)
    spec = RunSpec(args.url, args.model, workload, args.duration, args.warmup,
                   args.request_timeout, args.max_requests, args.api_key,
                   {"ignore_eos": True} if args.ignore_eos else {}, args.session_header,
                   args.think_time)
    levels = sweep(spec, args.concurrency, not args.no_progress)
    print(f"{args.workload} against {args.url} ({args.model}), {args.duration:g} s per level; "
          "latencies in ms")
    print(format_table(levels))
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"url": args.url, "model": args.model,
                                   "workload": dataclasses.asdict(workload),
                                   "duration_s": args.duration,
                                   "levels": levels}, indent=2) + "\n")
        print(f"wrote {out}")
    if args.plot:
        plot_levels({args.workload: levels}, args.plot, f"slimkv loadtest: {args.model}")
        print(f"wrote {args.plot}")
    return 0
