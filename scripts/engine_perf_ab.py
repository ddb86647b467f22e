"""Where an engine decode step's CPU time goes, per KV dtype, from `perf record` (cpu-clock)
of blocks of whole steps taken in turn on engines that are all alive at once (so the host's
slow and fast phases hit every dtype): CPU ms per step of the top symbols, per block.

    PYTHONPATH=$PWD .venv/bin/python scripts/engine_perf_ab.py [--kv int8 int4] [--seqs 16]

Needs `perf` (linux-perf) and permission to attach to this process; writes its data under a
temporary directory.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import tempfile
import time

from step_ab import block, prepared  # scripts/ is on sys.path when run as a script

from slimkv.bench.compare import decode_budget
from slimkv.config import Config

HZ = 2000


def recorded_block(engine, steps: int, out: str) -> float:
    perf = subprocess.Popen(["perf", "record", "-q", "-e", "cpu-clock", "-F", str(HZ), "-p",
                             str(os.getpid()), "-o", out], stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # perf attached
    ms = block(engine, steps)
    perf.send_signal(signal.SIGINT)
    perf.wait()
    return ms


def symbol_ms(data: str, steps: int) -> dict[str, float]:
    """CPU ms per step of each (library, symbol) in a perf data file."""
    report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort",
                             "dso,symbol", "-F", "sample,dso,symbol", "--stdio"],
                            capture_output=True, text=True, check=True).stdout
    out: dict[str, float] = collections.defaultdict(float)
    for line in report.splitlines():
        parts = line.split()
        if line.startswith("#") or len(parts) < 4:
            continue
        out[f"{parts[1].split('-')[0][:14]} {' '.join(parts[3:])[:40]}"] += (
            int(parts[0]) * 1000 / HZ / steps)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kv", nargs="+", default=["int8", "int4"])
    parser.add_argument("--seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--top", type=int, default=8)
    args = parser.parse_args()
    config = Config.load(None)
    new = decode_budget(config.scheduler.max_num_batched_tokens, [args.seqs], args.context,
                        args.steps * (args.reps + 1) + 2)
    engines = {kv: prepared(config, kv, True, args.context, new, args.seqs)[0] for kv in args.kv}
    for engine in engines.values():
        block(engine, 2)
    columns: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for kv, engine in engines.items():
                data = f"{tmp}/{kv}-{rep}.data"
                ms = recorded_block(engine, args.steps, data)
                columns[f"{kv}#{rep} ({ms:.1f} ms)"] = symbol_ms(data, args.steps)
    names = sorted({n for c in columns.values() for n in c},
                   key=lambda n: -sum(c.get(n, 0.0) for c in columns.values()))[:args.top]
    print(f"CPU ms per step ({args.seqs} x {args.context}), block wall ms per step in the header")
    print(" " * 56 + "  ".join(f"{c:>18s}" for c in columns))
    for name in names:
        print(f"{name:56s}" + "  ".join(f"{c.get(name, 0.0):18.1f}" for c in columns.values()))


if __name__ == "__main__":
    main()
