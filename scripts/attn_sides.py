"""The fused decode kernel at 32 sequences x 2K (30 layers, SmolLM2's shape; attn_bench's
caches) with K and V in different formats (int8 / int4 each, per-channel block key scales),
the four combinations called in turn 8 times: best and median ms per whole step. Says which
side an int4 cache's extra cost is on. A last argument `runs` lays each sequence's blocks
out in order (as the engine's prefill does) instead of anywhere in the pool.

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/attn_sides.py [runs]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_bench import BS, DIM, HEADS, KV_HEADS, LAYERS, setup  # noqa: E402

from slimkv.kernels import decode_kernel, describe  # noqa: E402

BATCH, CONTEXT = 32, 2048
COMBOS = [("int8", "int8"), ("int4", "int8"), ("int8", "int4"), ("int4", "int4")]


def step_for(k_kv: str, v_kv: str, tables_kind: str):
    cache, staging, tables, lens = setup(k_kv, BATCH, CONTEXT, LAYERS, tables_kind, v_kv)
    sides = [tuple(describe(cache.layer_codecs[l][s], cache.layer_pool(s, l)) for s in "kv")
             for l in range(LAYERS)]
    q, slots, kernel = torch.randn(BATCH, HEADS, DIM), torch.arange(BATCH), decode_kernel()

    def step() -> None:
        for l in range(LAYERS):
            kernel(q, tables, lens, *sides[l], KV_HEADS, BS, DIM ** -0.5,
                   (*staging.layer_buffers(l), slots))
    return step


def main() -> None:
    tables_kind = sys.argv[1] if len(sys.argv) > 1 else "random"
    steps = {combo: step_for(*combo, tables_kind) for combo in COMBOS}
    times = {combo: [] for combo in COMBOS}
    for _ in range(8):
        for combo, step in steps.items():
            start = time.perf_counter()
            step()
            times[combo].append((time.perf_counter() - start) * 1e3)
    for (k_kv, v_kv), ms in times.items():
        print(f"K {k_kv} / V {v_kv}: best {min(ms):.1f} median {statistics.median(ms):.1f} ms")


if __name__ == "__main__":
    main()
