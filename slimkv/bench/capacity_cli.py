"""``slimkv bench capacity``: run the sweep, write its JSON, ``bench/REPORT.md`` and plots."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from slimkv.cli import add_config_args, config_from_args


def _csv_int(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def add_capacity_cli(bench: argparse._SubParsersAction) -> None:
    from slimkv.bench.capacity import VARIANTS

    names = [v.name.replace(" ", "-") for v in VARIANTS]
    p = bench.add_parser("capacity", help="sessions served per KV variant under one KV budget")
    add_config_args(p)
    p.add_argument("--memory-gb", type=float, help="KV budget (default: sized for --sessions)")
    p.add_argument("--context", type=int, default=256, help="tokens per session (max_model_len)")
    p.add_argument("--doc-tokens", type=int, default=128, help="document a session opens with")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn")
    p.add_argument("--sessions", type=int, default=24,
                   help="contiguous bf16 sessions the default budget holds")
    p.add_argument("--concurrency", type=_csv_int, default=(8, 16, 24, 32, 48, 64))
    p.add_argument("--duration", type=float, default=30.0, help="seconds per level")
    p.add_argument("--variants", default=",".join(names), help=f"from {', '.join(names)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/capacity/capacity.json", help="JSON to write")
    p.add_argument("--report", default="bench/REPORT.md",
                   help="markdown report to write; its plots go to capacity/ beside it")
    p.add_argument("--from-json", help="only re-render the report from this saved JSON")
    p.add_argument("--merge", help="PATH[=LABEL],...: merge single-variant runs of one budget "
                   "into --out and render the report with the targets of issue 18")
    p.add_argument("--json", action="store_true", help="also print the JSON")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_bench_capacity)


def cmd_bench_capacity(args: argparse.Namespace) -> int:
    from slimkv.bench.capacity import VARIANTS, CapacitySpec, bench_capacity
    from slimkv.bench.capacity_report import write_report

    by_name = {v.name.replace(" ", "-"): v for v in VARIANTS}
    unknown = [n for n in args.variants.split(",") if n not in by_name]
    if unknown:
        raise ValueError(f"unknown variants {unknown}; choose from {', '.join(by_name)}")
    spec = CapacitySpec(args.context, args.doc_tokens, args.max_tokens, args.sessions,
                        args.concurrency, args.duration, args.memory_gb,
                        tuple(by_name[n] for n in args.variants.split(",")), args.seed)
    if args.merge:
        from slimkv.bench.capacity_targets import merge

        result = merge(args.merge.split(","))
        written = [_write_json(result, Path(args.out))]
    elif args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        written = []
    else:
        result = {"command": _command(),
                  **bench_capacity(config_from_args(args), spec, not args.no_progress)}
        written = [_write_json(result, Path(args.out))]
        print(f"took {result['elapsed_s'] / 60:.1f} min")
    command = result.get("command", "slimkv bench capacity")
    for path in written + write_report(result, Path(args.report), command):
        print(f"wrote {path}")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def _command() -> str:
    """The command line that produced a run, for the report's "Reproduce" section."""
    if sys.argv[1:3] == ["bench", "capacity"]:
        return "slimkv " + shlex.join(sys.argv[1:])
    return "slimkv bench capacity"


def _write_json(result: dict, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return out
