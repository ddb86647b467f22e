"""The batched workload (16 x 512 + 64) with the bf16 prefill attention kernel on and off
(torch's SDPA), alternated in one process so that the VM's drift hits both alike: tok/s
per run, best and median.

    flock /tmp/slimkv-cpu.lock timeout 600 .venv/bin/python scripts/ab_prefill_kernel.py bfloat16 [pairs]
"""
import statistics
import sys

from slimkv.attention import prefill
from slimkv.bench.compare import batched, engine_for
from slimkv.config import Config

kv = sys.argv[1] if len(sys.argv) > 1 else "bfloat16"
pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
kernel = prefill.prefill_kernel
eng = engine_for(Config.load(), kv, 16, 512 + 64)
batched(eng, 2, 64, 4)  # warm
rates = {"sdpa": [], "kernel": []}
for _ in range(pairs):
    for variant in rates:
        prefill.prefill_kernel = kernel if variant == "kernel" else (lambda: None)
        rates[variant].append(batched(eng, 16, 512, 64)["total_tok_s"])
for variant, r in rates.items():
    print(f"{kv} {variant}: best {max(r):.1f} tok/s, median {statistics.median(r):.1f}  "
          f"{[round(x, 1) for x in r]}")
