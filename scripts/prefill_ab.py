"""Prefill tok/s of bf16 KV, int8 KV, int8 KV read through a dequantized copy of its pool
blocks (``CpuBackend.read_codes = False``) and int8 KV with its staged pieces one kernel call
at a time (``CpuBackend.one_call_prefill = False``, the path before issue 47), interleaved in
one process: each round times every variant once per length, in a shuffled order, so a drift
of the machine (or what the run before leaves in the caches) falls on all of them. The model
dtype is what ``model.dtype: auto`` picks.
  PYTHONPATH=. .venv/bin/python scripts/prefill_ab.py --reps 5 --out bench/results/issue47/prefill_ab.json
Prints and writes the medians, every run, the ratios of the medians to bf16, and each
variant's per-round ratios to bf16 (their median with a bootstrap 95% interval: the rounds
are pairs, so that is the figure a drift disturbs least)."""
import argparse
import json
import random
import statistics

from slimkv.backends.cpu import CpuBackend
from slimkv.bench.compare import engine_for, prefill_rate
from slimkv.bench.timing import environment
from slimkv.config import Config

p = argparse.ArgumentParser()
p.add_argument("--lengths", default="512,2048")
p.add_argument("--reps", type=int, default=5)
p.add_argument("--variants", help="a comma-separated subset of the variants (bfloat16 always)")
p.add_argument("--out")
args = p.parse_args()
lengths = [int(x) for x in args.lengths.split(",")]
config = Config.load()
engines = {"bfloat16": engine_for(config, "bfloat16", 1, max(lengths) + 16),
           "int8": engine_for(config, "int8", 1, max(lengths) + 16)}
variants = {"bfloat16": ("bfloat16", True, True), "int8": ("int8", True, True),
            "int8 dequantized copy": ("int8", True, False),
            "int8 per piece": ("int8", False, False)}
if args.variants:
    unknown = set(args.variants.split(",")) - set(variants)
    if unknown:
        p.error(f"--variants: no such variant {sorted(unknown)}; choose from {list(variants)}")
    variants = {v: x for v, x in variants.items()
                if v == "bfloat16" or v in args.variants.split(",")}
runs = {v: {n: [] for n in lengths} for v in variants}


def run(name: str, n: int, seed: int) -> float:
    dtype, CpuBackend.one_call_prefill, CpuBackend.read_codes = variants[name]
    return prefill_rate(engines[dtype], n, seed=seed)


def paired(ratios: list[float]) -> dict:
    """The median of per-round ratios and its bootstrap 95% interval."""
    rng = random.Random(0)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(2000))
    return {"median": round(statistics.median(ratios), 3),
            "ci95": [round(boot[50], 3), round(boot[1949], 3)]}


for name in variants:  # warm-up: kernels built, allocator primed
    for n in lengths:
        run(name, n, 99)
order = random.Random(1)
for rep in range(args.reps):
    for n in lengths:  # each round in a new order: no variant always follows the same one
        for name in order.sample(list(variants), len(variants)):
            runs[name][n].append(run(name, n, rep))
CpuBackend.one_call_prefill = CpuBackend.read_codes = True
medians = {v: {n: statistics.median(r[n]) for n in lengths} for v, r in runs.items()}
result = {"machine": environment(), "model_dtype": str(engines["bfloat16"].runner.dtype),
          "reps": args.reps, "unit": "prefill tok/s (one prompt, median)",
          "medians": medians, "runs": runs,
          "ratios_to_bf16": {v: {n: round(m[n] / medians["bfloat16"][n], 3) for n in lengths}
                             for v, m in medians.items() if v != "bfloat16"},
          "paired_ratios_to_bf16": {
              v: {n: paired([a / b for a, b in zip(r[n], runs["bfloat16"][n])])
                  for n in lengths} for v, r in runs.items() if v != "bfloat16"}}
print(json.dumps({k: result[k] for k in ("model_dtype", "medians", "ratios_to_bf16",
                                         "paired_ratios_to_bf16")}, indent=1))
if args.out:
    from pathlib import Path
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
