"""Prefill steps only: N prompts of 512 random tokens, 1 new token each; prints each step's
ms (min / median) and, with a third argument, a cProfile of those steps.

    flock /tmp/slimkv-cpu.lock timeout 200 .venv/bin/python scripts/prof_prefill.py int8 8 [prof]
"""
import cProfile
import pstats
import statistics
import sys
import time

from slimkv.bench.compare import batched, engine_for
from slimkv.config import Config

kv = sys.argv[1] if len(sys.argv) > 1 else "int8"
num = int(sys.argv[2]) if len(sys.argv) > 2 else 8
eng = engine_for(Config.load(), kv, 16, 512 + 64)
batched(eng, 2, 512, 1)  # warm
orig, times = eng.step, []


def step():
    t = time.perf_counter()
    r = orig()
    times.append(time.perf_counter() - t)
    return r


eng.step = step
prof = cProfile.Profile() if len(sys.argv) > 3 else None
if prof:
    prof.enable()
batched(eng, num, 512, 1)
if prof:
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
ms = [round(t * 1000) for t in times]
print(kv, "prefill step ms min", min(ms[:num]), "median", statistics.median(ms[:num]), ms)
