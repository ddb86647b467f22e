"""``slimkv eval``: accuracy across KV dtypes, with a regression gate on the serving dtype."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from slimkv.cli import add_config_args, config_from_args, print_json
from slimkv.config import Config

DEFAULT_DTYPES = "float32,bfloat16,int8,fp8,int4"


def _csv(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def _percent(text: str) -> float:
    return float(text.rstrip("%"))


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity, KL, top-1 and long-context recall per KV dtype")
    add_config_args(p)
    p.add_argument("--kv-dtypes", type=_csv, default=_csv(DEFAULT_DTYPES),
                   help=f"dtypes to evaluate (default {DEFAULT_DTYPES})")
    p.add_argument("--reference", default="float32", help="reference KV dtype (default float32)")
    p.add_argument("--suite", choices=("quick", "full", "stats"), default="quick",
                   help="stats: 200 sliding windows with bootstrap intervals, 10 passkeys "
                        "per cell with McNemar counts, and the floor (docs/accuracy.md)")
    p.add_argument("--floor", type=int, metavar="CHUNK",
                   help="also run the reference prefilled CHUNK tokens a step (the rounding "
                        "floor; default: the suite's, 64 for stats; 0: none)")
    p.add_argument("--serving", type=_csv,
                   help="dtypes the gate applies to (default: the config's kv_cache.dtype)")
    p.add_argument("--max-regression", type=_percent, default=1.0,
                   help="gate: worst allowed regression, e.g. 1%% (perplexity: percent; "
                        "task accuracy: points)")
    p.add_argument("--keys", type=int, help="passkey keys per cell (default: the suite's)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", help="also write the JSON here")
    p.add_argument("--markdown", help="also write the markdown table here")
    p.add_argument("--plot", help="write a PNG plot here")
    p.add_argument("--no-progress", action="store_true")
    _add_sensitivity_args(p)
    p.set_defaults(func=cmd_eval)


def _add_sensitivity_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("per-layer sensitivity (see slimkv/eval/sensitivity.py)")
    g.add_argument("--sensitivity", action="store_true",
                   help="quantize one layer at a time, rank the layers and propose "
                        "kv_cache.layer_dtypes for --target-bits")
    g.add_argument("--low", default="int4", help="dtype of the layers left low (default int4)")
    g.add_argument("--high", default="int8", help="dtype of the sensitive layers (default int8)")
    g.add_argument("--target-bits", type=float, default=6.0,
                   help="average stored bits per KV value, scales included (default 6)")
    g.add_argument("--rank-by", choices=("perplexity", "kl"), default="perplexity")
    g.add_argument("--windows", type=int,
                   help="corpus windows: the first N (default: the suite's; also for a "
                        "smaller eval run)")
    g.add_argument("--window", type=int, help="tokens per window (default: the suite's)")


def cmd_eval(args: argparse.Namespace) -> int:
    from slimkv.eval.harness import SUITES, run_eval
    from slimkv.eval.report import gate, markdown, text_table, to_json

    config = config_from_args(args)
    if args.sensitivity:
        return cmd_sensitivity(args, config)
    serving = args.serving or [config.kv_cache.dtype]
    suite = SUITES[args.suite]
    if args.windows or args.keys:   # a smaller run of the suite (first windows, fewer keys)
        suite = dataclasses.replace(suite, num_windows=args.windows or suite.num_windows,
                                    keys_per_cell=args.keys or suite.keys_per_cell)
    ev = run_eval(config, args.kv_dtypes, suite, args.reference,
                  progress=not args.no_progress, floor_chunk=args.floor)
    result = to_json(ev, serving, args.max_regression)
    if args.out:
        _write(args.out, json.dumps(result, indent=2) + "\n")
    if args.markdown:
        _write(args.markdown, markdown(ev) + "\n")
    if args.plot:
        from slimkv.eval.plot import plot

        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(ev, args.plot)
    if args.json:
        print_json(result)
    else:
        print(text_table(ev))
        for failure in gate(ev, serving, args.max_regression):
            print(f"GATE FAILED: {failure}")
    return 0 if result["gate"]["passed"] else 1


def cmd_sensitivity(args: argparse.Namespace, config: Config) -> int:
    from slimkv.eval.harness import SUITES
    from slimkv.eval.sensitivity import run_sensitivity, text_report

    suite = SUITES[args.suite]
    run = run_sensitivity(config, low=args.low, high=args.high, reference=args.reference,
                          target_bits=args.target_bits, rank_by=args.rank_by,
                          window=args.window or suite.window,
                          num_windows=args.windows or suite.num_windows,
                          progress=not args.no_progress)
    if args.out:
        _write(args.out, json.dumps(run.to_dict(), indent=2) + "\n")
    if args.json:
        print_json(run.to_dict())
    else:
        print(text_report(run))
    return 0


def _write(path: str, text: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(text)
