"""Single-stream decode ms/step (compare bench's engine and workload: 16-token prompt,
128 new tokens, greedy), optionally with a cProfile of the decode steps.

Usage: PYTHONPATH=$PWD python scripts/lean_step.py [--kv int8] [--reps 3] [--profile N]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats

from slimkv.bench.compare import decode_rate, engine_for, prefill_rate
from slimkv.config import Config


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv", default="int8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--profile", type=int, default=0, help="print the top N of a cProfile")
    args = ap.parse_args()
    engine = engine_for(Config.load(), args.kv, 8, 2400)
    prefill_rate(engine, 16)  # warm-up
    print("weights:", engine.runner.weights_class, "dtype:", engine.runner.dtype)
    ms = sorted(1000 / decode_rate(engine, 1, 16, 128) for _ in range(args.reps))
    print(f"single stream after 16, ms/step over {args.reps} runs: min {ms[0]:.2f} "
          f"median {ms[len(ms) // 2]:.2f} max {ms[-1]:.2f}", flush=True)
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        decode_rate(engine, 1, 16, 128)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)


if __name__ == "__main__":
    main()
