"""Single-stream (1 x 128 tokens after 16, best of 3) and parallel8 (8 x 128 after 16, best
of 2) decode with the default config, through bench/compare's workload functions, with
model.activations ACTIVATIONS (default: the config's, precise).

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/bench_decode_rates.py [KV_DTYPE] [ACTIVATIONS]
"""

from __future__ import annotations

import sys

from slimkv.bench.compare import decode_rate, engine_for, prefill_rate
from slimkv.config import Config

kv = sys.argv[1] if len(sys.argv) > 1 else "int8"
config = Config.load(None)
if len(sys.argv) > 2:
    config = config.replace("model", activations=sys.argv[2])
engine = engine_for(config, kv, 8, 16 + 160)
prefill_rate(engine, 16)  # warm-up
single = max(decode_rate(engine, 1, 16, 128) for _ in range(3))
par8 = max(decode_rate(engine, 8, 16, 128) for _ in range(2))
print(f"kv={kv} activations={config.model.activations} single after 16: {single} tok/s = "
      f"{1000 / single:.2f} ms/step; parallel8: {par8} tok/s = {8000 / par8:.2f} ms/step")
