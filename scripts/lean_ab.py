"""One decode step of a single sequence (16-token prompt + a few tokens, default config),
re-run in place: ``runner.execute`` of the same scheduled step (it rewrites the same KV
slot), timed in blocks; with ``--ab module:attr=module:attr`` the two implementations
alternate block by block (same process, same moment: small deltas show).

Usage: PYTHONPATH=$PWD python scripts/lean_ab.py [--blocks 20] [--n 100] [--ab A=B]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time

from slimkv.bench.compare import engine_for, greedy
from slimkv.config import Config
from slimkv.workload import random_prompt


def resolve(spec: str):
    module, _, attr = spec.partition(":")
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    return owner, name, getattr(owner, name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=20)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--ab", default=None, help="target=replacement, e.g. m:Cls.fn=m2:Cls.fn")
    args = ap.parse_args()
    engine = engine_for(Config.load(), "int8", 8, 2400)
    seq = engine.add_request(random_prompt(16, engine.model_args.vocab_size, seed=50), greedy(64))
    for _ in range(4):
        engine.step()
    captured = []
    execute = engine.runner.execute
    engine.runner.execute = lambda scheduled: captured.append(scheduled) or execute(scheduled)
    engine.step()
    scheduled = captured[0]
    assert [n for _, n in scheduled] == [1], scheduled
    variants = [("current", None)]
    if args.ab:
        target, _, repl = args.ab.partition("=")
        owner, name, a = resolve(target)
        variants = [("A " + target, a), ("B " + repl, resolve(repl)[2])]
    times = {label: [] for label, _ in variants}
    for _ in range(args.blocks):
        for label, fn in variants:
            if fn is not None:
                setattr(owner, name, fn)
            start = time.perf_counter()
            for _ in range(args.n):
                execute(scheduled)
            times[label].append(1000 * (time.perf_counter() - start) / args.n)
    for label, ms in times.items():
        ms.sort()
        print(f"{label}: ms/step min {ms[0]:.3f} median {statistics.median(ms):.3f} "
              f"(blocks of {args.n}, seq {seq.request_id})")


if __name__ == "__main__":
    main()
