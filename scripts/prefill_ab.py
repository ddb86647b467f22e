"""Prefill tok/s of bf16 KV, int8 KV, and int8 KV with its staged pieces one kernel call at a
time (``CpuBackend.one_call_prefill = False``, the path before issue 47), interleaved in one
process: each round times every variant once per length, in turn, so a drift of the machine
falls on all of them. The model dtype is what ``model.dtype: auto`` picks.
  PYTHONPATH=. .venv/bin/python scripts/prefill_ab.py --reps 5 --out bench/results/issue47/prefill_ab.json
Prints and writes the medians, every run, and the ratios to bf16."""
import argparse
import json
import statistics

from slimkv.backends.cpu import CpuBackend
from slimkv.bench.compare import engine_for, prefill_rate
from slimkv.bench.timing import environment
from slimkv.config import Config

p = argparse.ArgumentParser()
p.add_argument("--lengths", default="512,2048")
p.add_argument("--reps", type=int, default=5)
p.add_argument("--out")
args = p.parse_args()
lengths = [int(x) for x in args.lengths.split(",")]
config = Config.load()
engines = {"bfloat16": engine_for(config, "bfloat16", 1, max(lengths) + 16),
           "int8": engine_for(config, "int8", 1, max(lengths) + 16)}
variants = {"bfloat16": ("bfloat16", True), "int8": ("int8", True),
            "int8 per piece": ("int8", False)}
runs = {v: {n: [] for n in lengths} for v in variants}
for name, (dtype, one_call) in variants.items():  # warm-up: kernels built, allocator primed
    CpuBackend.one_call_prefill = one_call
    for n in lengths:
        prefill_rate(engines[dtype], n, seed=99)
for rep in range(args.reps):
    for n in lengths:
        for name, (dtype, one_call) in variants.items():
            CpuBackend.one_call_prefill = one_call
            runs[name][n].append(prefill_rate(engines[dtype], n, seed=rep))
CpuBackend.one_call_prefill = True
medians = {v: {n: statistics.median(r[n]) for n in lengths} for v, r in runs.items()}
result = {"machine": environment(), "model_dtype": str(engines["bfloat16"].runner.dtype),
          "reps": args.reps, "unit": "prefill tok/s (one prompt, median)",
          "medians": medians, "runs": runs,
          "ratios_to_bf16": {v: {n: round(m[n] / medians["bfloat16"][n], 3) for n in lengths}
                             for v, m in medians.items() if v != "bfloat16"}}
print(json.dumps({k: result[k] for k in ("model_dtype", "medians", "ratios_to_bf16")}, indent=1))
if args.out:
    from pathlib import Path
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
