"""The one-call decode step (slimkv.kernels.step) against the per-op path, interleaved in
one process: ``num_seqs`` x 128 tokens after 16 (bench compare's decode workload), the
step's ``enabled`` flag toggled between repetitions; ms per step (per token for 1 seq).

Usage: PYTHONPATH=$PWD python scripts/one_call_ab.py [KV_DTYPE=int8] [NUM_SEQS=1] [REPS=4]
"""

from __future__ import annotations

import statistics
import sys

from slimkv.bench.compare import decode_rate, engine_for, prefill_rate
from slimkv.config import Config

kv, num_seqs, reps = (sys.argv[1:] + ["int8", "1", "4"][len(sys.argv) - 1:])[:3]
num_seqs, reps = int(num_seqs), int(reps)
engine = engine_for(Config.load(), kv, 8, 2208)
prefill_rate(engine, 16)  # warm-up
ms: dict[bool, list[float]] = {False: [], True: []}
for _ in range(reps):
    for enabled in (False, True):
        engine.runner.lean_step.enabled = enabled
        ms[enabled].append(1000 * num_seqs / decode_rate(engine, num_seqs, 16, 128))
for enabled, runs in ms.items():
    print(f"kv={kv} seqs={num_seqs} {'one-call step' if enabled else 'per-op path  '} ms/step "
          f"median {statistics.median(runs):.2f} min {min(runs):.2f} "
          f"({' '.join(f'{m:.2f}' for m in runs)})")
