"""``slimkv bench ...`` commands."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from slimkv.bench.capacity_cli import add_capacity_cli
from slimkv.bench.cluster import add_cluster_cli
from slimkv.bench.kernels_cli import add_ab_cli, add_kernels_cli
from slimkv.bench.offload import add_offload_cli
from slimkv.bench.simulate_cli import add_simulate_cli
from slimkv.bench.soak import add_soak_cli
from slimkv.cli import add_config_args, config_from_args, csv_of, write_result


def add_cli(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="benchmarks that write JSON").add_subparsers(
        dest="bench", required=True)
    p = bench.add_parser("engine", help="prefill and decode tokens/s per KV dtype")
    add_config_args(p)
    p.add_argument("--kv-dtypes", type=csv_of(str), default=["bfloat16", "int8", "fp8", "int4"])
    p.add_argument("--prompt-lens", type=csv_of(int), default=[512, 2048])
    p.add_argument("--batches", type=csv_of(int), default=[1, 8, 32])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--out", default="bench/results/engine.json", help="JSON file to write")
    p.add_argument("--json", action="store_true", help="also print the JSON")
    p.set_defaults(func=cmd_bench_engine)
    p = bench.add_parser("scheduling", help="lanes (fcfs vs weighted) and paged vs contiguous")
    add_config_args(p)
    p.add_argument("--long-tokens", type=int, default=4096)
    p.add_argument("--out", default="bench/results/scheduling.json", help="JSON file to write")
    p.add_argument("--json", action="store_true", help="also print the JSON")
    p.set_defaults(func=cmd_bench_scheduling)
    p = bench.add_parser("compare", help="slimkv vs vLLM-CPU and llama.cpp, side by side")
    add_config_args(p)
    p.add_argument("--kv-dtypes", type=csv_of(str), default=["bfloat16", "int8", "int4"])
    p.add_argument("--model-dtype", default=None,
                   help="pin slimkv's model dtype (default: the config's, `auto`; a pinned "
                        "dtype also keeps unquantized weights)")
    p.add_argument("--reps", type=int, default=3,
                   help="repetitions of every measurement (medians are compared; slimkv's "
                        "dtypes and vLLM-CPU take turns run by run)")
    p.add_argument("--no-peers", action="store_true", help="measure slimkv only")
    p.add_argument("--peer-scripts", type=Path, help="the peers' drivers (../shared/peers)")
    p.add_argument("--peer-envs", type=Path, help="their venvs (~/.cache/slimkv-peers)")
    p.add_argument("--out", default="bench/compare/compare.json", help="JSON file to write")
    p.add_argument("--plot", default="bench/compare/compare.png", help="PNG of the ratios")
    p.add_argument("--json", action="store_true", help="also print the JSON")
    p.set_defaults(func=cmd_bench_compare)
    add_capacity_cli(bench)
    add_cluster_cli(bench)
    add_offload_cli(bench)
    add_simulate_cli(bench)
    add_soak_cli(bench)
    add_kernels_cli(bench)
    add_ab_cli(bench)


def cmd_bench_engine(args: argparse.Namespace) -> int:
    from slimkv.bench.engine import bench_engine

    def save(partial: dict) -> None:  # after every dtype: a run cut short keeps what it has
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(partial, indent=2) + "\n")

    result = bench_engine(config_from_args(args), args.kv_dtypes, args.prompt_lens,
                          args.batches, args.context, args.new_tokens, on_result=save)
    write_result(result, args)
    return 1 if any("error" in row for row in result["results"].values()) else 0


def cmd_bench_scheduling(args: argparse.Namespace) -> int:
    from slimkv.bench.scheduling import bench_scheduling

    return write_result(bench_scheduling(config_from_args(args), args.long_tokens), args)


def cmd_bench_compare(args: argparse.Namespace) -> int:
    from slimkv.bench.compare import bench_compare
    from slimkv.bench.compare_report import format_ratios, plot
    from slimkv.bench.peers import Peers

    config = config_from_args(args)
    if args.model_dtype:
        config = config.replace("model", dtype=args.model_dtype)
    peers = None if args.no_peers else Peers(
        **{k: v for k, v in (("scripts", args.peer_scripts), ("envs", args.peer_envs)) if v})
    result = bench_compare(config, args.kv_dtypes, peers, args.reps)
    write_result(result, args)
    print(format_ratios(result))
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    return 0
