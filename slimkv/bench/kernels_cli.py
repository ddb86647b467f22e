"""``slimkv bench kernels`` and ``slimkv bench ab``: arguments and the JSON they write.

Both measure for seconds to minutes at their default sizes and are sensitive to other load:
on a shared host run them under the CPU lock, ``flock /tmp/slimkv-cpu.lock slimkv bench ...``.
"""

from __future__ import annotations

import argparse

from slimkv.cli import csv_of, write_result


def add_kernels_cli(bench: argparse._SubParsersAction) -> None:
    from slimkv.bench.kernels import PARTS

    p = bench.add_parser("kernels", help="decode/prefill attention, weight GEMMs and memory "
                         "rate of this host's kernels")
    p.add_argument("--parts", type=csv_of(str), default=list(PARTS), help=",".join(PARTS))
    p.add_argument("--kv-dtypes", type=csv_of(str), default=["bfloat16", "int8", "int4"],
                   help="decode: KV dtypes, K/V mixes as e.g. int4/int8")
    p.add_argument("--batches", type=csv_of(int), default=[16, 32], help="decode: sequences")
    p.add_argument("--context", type=int, default=2048, help="decode: tokens per sequence")
    p.add_argument("--tables", choices=["runs", "random"], default="runs",
                   help="decode: each sequence's blocks in order, or anywhere in the pool")
    p.add_argument("--layers", type=int, default=30,
                   help="decode, gemm: layers timed (the model has 30)")
    p.add_argument("--rows", type=csv_of(int), default=[1, 8, 32, 512], help="gemm: rows (M)")
    p.add_argument("--kernel-rows", type=int, default=64,
                   help="gemm: the most rows the int8 kernel is timed at; rows: from here + 1")
    p.add_argument("--vocab", type=int, default=49152, help="gemm: rows of the LM head")
    p.add_argument("--prefill-tokens", type=int, default=512,
                   help="prefill: chunk tokens; rows: up to here")
    p.add_argument("--mem-mib", type=int, default=1024, help="memory: buffer size")
    p.add_argument("--reps", type=int, default=7, help="rounds of every measurement")
    p.add_argument("--dtype", help="model dtype to measure in (default: what auto picks)")
    _add_output(p, "bench/results/kernels.json")
    p.set_defaults(func=cmd_bench_kernels)


def add_ab_cli(bench: argparse._SubParsersAction) -> None:
    p = bench.add_parser("ab", help="A/B of two kernel builds or two engine configs, "
                         "interleaved in one process")
    p.add_argument("--builds", nargs=2, metavar=("A", "B"),
                   help="two directories of slimkv/kernels sources, each DIR[:-DFLAG...] "
                        "(prefill: or sdpa)")
    p.add_argument("--kernel", choices=["decode", "prefill", "engine"], default="decode",
                   help="with --builds: what to time")
    p.add_argument("--configs", nargs=2, metavar=("A", "B"), default=[None, None],
                   help="two YAML configs (default: the embedded one, or name it 'default')")
    for side in ("a", "b", ""):
        p.add_argument(f"--set{side and '-' + side}", dest=f"set_{side or 'both'}",
                       action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help=f"override in config {side.upper() or 'A and B'}")
    p.add_argument("--kv-dtypes", type=csv_of(str), default=["int8", "int4"],
                   help="decode and engine builds: KV dtypes (decode: K/V mixes too)")
    p.add_argument("--batch", type=int, default=32, help="sequences decoding")
    p.add_argument("--context", type=int, default=2048, help="tokens per sequence")
    p.add_argument("--layers", type=int, default=30, help="decode builds: layers timed")
    p.add_argument("--prefill-tokens", type=int, default=512, help="prefill builds: chunk")
    p.add_argument("--steps", type=int, default=4, help="engine: steps per timed block")
    p.add_argument("--reps", type=int, default=5, help="rounds (each variant once a round)")
    _add_output(p, "bench/results/ab.json")
    p.set_defaults(func=cmd_bench_ab)


def _add_output(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--out", default=default, help="JSON file to write")
    p.add_argument("--json", action="store_true", help="also print the JSON")


def cmd_bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from slimkv.bench.kernels import bench_kernels

    result = bench_kernels(args.parts, args.kv_dtypes, args.batches, args.context,
                           args.layers, args.rows, args.kernel_rows, args.prefill_tokens,
                           args.mem_mib, args.reps, args.dtype and getattr(torch, args.dtype),
                           args.tables, args.vocab)
    return write_result(result, args)


def cmd_bench_ab(args: argparse.Namespace) -> int:
    from slimkv.bench.ab import ab_builds, ab_configs, load_config

    def config(side: int):
        return load_config(args.configs[side], args.set_both + (args.set_a, args.set_b)[side])

    if args.builds:
        engine = config(0)[0] if args.kernel == "engine" else None
        result = ab_builds(args.builds, args.kernel, args.kv_dtypes, args.batch, args.context,
                           args.layers, args.prefill_tokens, args.reps, args.steps, engine)
    else:
        (a, label_a), (b, label_b) = config(0), config(1)
        result = ab_configs((a, b), [label_a, label_b], args.batch, args.context, args.reps,
                            args.steps)
    for group, row in result["results"].items():
        print(f"{group}: " + ", ".join(f"{n} {row[n]['best_ms']:.3f} / {row[n]['median_ms']:.3f}"
                                       for n in "AB")
              + f" ms (best / median), B/A {row['b_over_a']['best']:.3f} / "
                f"{row['b_over_a']['median']:.3f}"
              + (f", max abs diff {row['max_abs_diff']:.3g}" if "max_abs_diff" in row else ""))
    return write_result(result, args)
