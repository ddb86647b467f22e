"""``slimkv bench simulate {case,calibrate,fleet,report}``: the capacity simulator
(slimkv/simulate/, method in docs/capacity.md); JSON and plots go to bench/simulate/."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
from pathlib import Path

OUT = Path("bench/simulate")


def _csv(kind: type):
    return lambda text: tuple(kind(x) for x in text.split(",") if x)


def _quiet() -> None:
    """The scheduler logs every watermark crossing: thousands in a simulated hour."""
    import logging

    logging.getLogger("slimkv.engine.scheduler").setLevel(logging.ERROR)


def add_simulate_cli(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("simulate", help="capacity at the case's scale: the real scheduler "
                         "on a simulated clock with a device step-time model")
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("case", help="one card: sessions, TTFT, TPOT per KV layout and policy")
    c.add_argument("--model", default="llama-2-7b")
    c.add_argument("--device", default="A100-80GB")
    c.add_argument("--context", type=int, default=4096)
    c.add_argument("--doc-tokens", type=int, default=2048)
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--levels", type=_csv(int), default=(8, 16, 24, 32, 40, 48, 56, 64, 80, 96))
    c.add_argument("--duration", type=float, default=300.0, help="simulated seconds per level")
    c.add_argument("--warmup", type=float, default=60.0)
    c.add_argument("--policy-level", type=int, default=128)
    c.add_argument("--variants", type=_csv(str), default=None,
                   help="KV layouts to sweep, e.g. bfloat16:contiguous,bfloat16,int8,fp8_e4m3,"
                   "int4 (default: all five); results merge into the case's JSON, so a long "
                   "case runs in pieces")
    c.add_argument("--policies", type=_csv(str), default=("bfloat16", "int8", "int4"),
                   help="KV dtypes of the policy table ('' for none)")
    c.set_defaults(func=cmd_case)
    k = sub.add_parser("calibrate", help="fit the CPU step model to the real engine (slow)")
    k.add_argument("--kv-dtypes", type=_csv(str), default=("bfloat16", "int8"))
    k.add_argument("--fit-levels", type=_csv(int), default=(4, 8),
                   help="client counts whose steps the CPU constants are fitted on together")
    k.add_argument("--test-level", type=int, default=16)
    k.add_argument("--duration", type=float, default=40.0, help="wall seconds per level")
    k.set_defaults(func=cmd_calibrate)
    f = sub.add_parser("fleet", help="N replicas routed by cluster.policy.route")
    f.add_argument("--model", default="llama-2-7b")
    f.add_argument("--device", default="A100-80GB")
    f.add_argument("--sessions", type=_csv(int), default=(1000, 10000))
    f.add_argument("--variants", type=_csv(str), default=("bfloat16", "int8"))
    f.add_argument("--think-time", type=float, default=30.0)
    f.add_argument("--duration", type=float, default=300.0)
    f.add_argument("--warmup", type=float, default=60.0)
    f.add_argument("--cards", type=int, default=None,
                   help="run every load on this many cards (no bisection); rows are merged "
                   "into the model's fleet JSON, so a long sweep can run in pieces")
    f.add_argument("--cards-range", type=_csv(int), default=None,
                   help="LOW,HIGH: the bisection's card counts (default: load/400 to load/20)")
    f.set_defaults(func=cmd_fleet)
    r = sub.add_parser("report", help="re-render bench/simulate/results.md from the JSON")
    r.set_defaults(func=cmd_report)
    for q in (c, k, f, r):
        q.add_argument("--out-dir", type=Path, default=OUT)


def _write(obj: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"command": "slimkv " + shlex.join(sys.argv[1:]), **obj},
                               indent=2) + "\n")
    print(f"wrote {path}")


def cmd_case(args: argparse.Namespace) -> int:
    _quiet()
    from slimkv.simulate.capacity import VARIANTS, CaseSpec, merge_case, run_case
    from slimkv.simulate.card import Variant

    spec = CaseSpec(args.model, args.device, args.context, args.doc_tokens, args.max_tokens,
                    args.levels, args.duration, args.warmup)
    variants = VARIANTS if args.variants is None else tuple(
        Variant(v.split(":")[0], not v.endswith(":contiguous")) for v in args.variants)
    result = run_case(spec, variants, args.policy_level, policy_dtypes=args.policies)
    result["command"] = "slimkv " + shlex.join(sys.argv[1:])
    path = args.out_dir / f"case-{args.model}-{args.device}.json"
    old = json.loads(path.read_text()) if path.is_file() else None
    _write(merge_case(old, result), path)
    return cmd_report(args)


def cmd_calibrate(args: argparse.Namespace) -> int:
    _quiet()
    from slimkv.bench.engine import machine_info
    from slimkv.config import Config
    from slimkv.simulate.calibrate import calibrate
    from slimkv.simulate.workload import SessionSpec

    spec = SessionSpec(256, 128, 16)
    runs = []
    for dtype in args.kv_dtypes:
        config = (Config().replace("model", max_model_len=spec.context)
                  .replace("kv_cache", dtype=dtype, num_blocks=1200))
        runs.append(calibrate(config, spec, args.fit_levels, args.test_level, args.duration))
        e = runs[-1]["step_error_test"]
        print(f"  {dtype}: held-out decode step error median {e['decode'].get('median')}, "
              f"all steps {e['all']['median']}", flush=True)
    path, machine = args.out_dir / "calibration.json", machine_info()
    for run in runs:   # each run keeps its own command and machine: dtypes run in pieces
        run.update(command="slimkv " + shlex.join(sys.argv[1:]), machine=machine)
    old = json.loads(path.read_text())["runs"] if path.is_file() else []
    new = {r["kv_dtype"] for r in runs}
    runs = [r for r in old if r["kv_dtype"] not in new] + runs
    _write({"machine": machine, "workload": dataclasses.asdict(spec), "runs": runs}, path)
    return cmd_report(args)


def cmd_fleet(args: argparse.Namespace) -> int:
    _quiet()
    from slimkv.simulate.fleet import fleet_rows, merge_rows

    result = fleet_rows(args.model, args.device, args.variants, args.sessions,
                        args.think_time, args.duration, args.warmup, args.cards,
                        args.cards_range)
    command = "slimkv " + shlex.join(sys.argv[1:])
    for row in result["rows"]:
        row["command"] = command
    path = args.out_dir / f"fleet-{args.model}-{args.device}-{args.duration:g}s.json"
    old = json.loads(path.read_text()) if path.is_file() else None
    _write(merge_rows(old, result), path)
    return cmd_report(args)


def cmd_report(args: argparse.Namespace) -> int:
    from slimkv.simulate.report import write_results

    for path in write_results(args.out_dir):
        print(f"wrote {path}")
    return 0
