"""The batched workload (16 x 512 + 64), the AMX paths (tile GEMM, int8 tiles in qgemm) on and off, alternated in one
process (this VM's speed drifts between minutes): wall seconds per run, best and median.

    flock /tmp/slimkv-cpu.lock timeout 230 .venv/bin/python scripts/ab_batched.py int8 [pairs]
"""
import statistics
import sys

from slimkv.bench.compare import batched, engine_for
from slimkv.config import Config
from slimkv.model.quant import QuantLinear

kv = sys.argv[1] if len(sys.argv) > 1 else "int8"
pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
eng = engine_for(Config.load(), kv, 16, 512 + 64)
linears = [m for m in eng.runner.model.modules() if isinstance(m, QuantLinear)]
tiles = {m: m.tiles for m in linears}
batched(eng, 2, 64, 4)  # warm
walls = {"old": [], "new": []}
for _ in range(pairs):
    for variant in ("old", "new"):
        for m in linears:
            m.tiles = tiles[m] if variant == "new" else None
        linears[0].kernel.amx_rows(16 if variant == "new" else 1 << 30)
        walls[variant].append(batched(eng, 16, 512, 64)["wall_s"])
for variant, w in walls.items():
    print(f"{kv} {variant}: best {min(w):.2f} s median {statistics.median(w):.2f} s  {w}")
