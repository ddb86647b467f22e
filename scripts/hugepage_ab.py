"""A/B of the KV pool on transparent huge pages vs ordinary 4 KiB pages, decode kernel alone:
for each KV dtype, one cache of each kind (attn_bench's setup, B sequences x 2K, 30
layers), all timed in turn (dtypes and page kinds interleaved), the best of REPS whole
steps kept. Also prints how much of each pool ``AnonHugePages`` says is on huge pages.

    flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/hugepage_ab.py int8,int4,bfloat16 16 8
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_bench import BS, DIM, HEADS, KV_HEADS, LAYERS, setup  # noqa: E402

import slimkv.kv.cache as cache_module  # noqa: E402
from slimkv.kernels import decode_kernel, describe  # noqa: E402


def huge_kib() -> int:
    text = Path("/proc/self/smaps_rollup").read_text()
    return int(re.search(r"AnonHugePages:\s+(\d+)", text).group(1))


def ordinary(shape, value, dtype, device):
    return torch.full(shape, value, dtype=dtype, device=device)


def prepared(kv: str, batch: int, huge: bool):
    before, real = huge_kib(), cache_module.filled
    cache_module.filled = real if huge else ordinary
    try:
        cache, staging, tables, lens = setup(kv, batch, 2048, LAYERS)
    finally:
        cache_module.filled = real
    share = (huge_kib() - before) * 1024 / cache.nbytes
    sides = [tuple(describe(cache.layer_codecs[l][s], cache.layer_pool(s, l)) for s in "kv")
             for l in range(LAYERS)]
    return (cache, staging, tables, lens, sides), share


def step(kernel, q, slots, setup_) -> float:
    cache, staging, tables, lens, sides = setup_
    start = time.perf_counter()
    for l in range(LAYERS):
        staged = None if staging is None else (*staging.layer_buffers(l), slots)
        kernel(q, tables, lens, *sides[l], KV_HEADS, BS, DIM ** -0.5, staged)
    return time.perf_counter() - start


def main() -> None:
    kvs, batch, reps = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
    kernel, q, slots = decode_kernel(), torch.randn(batch, HEADS, DIM), torch.arange(batch)
    runs = {}
    for kv in kvs:
        for huge in (False, True):
            runs[kv, huge], share = prepared(kv, batch, huge)
            print(f"{kv} huge={huge}: {100 * share:.0f}% of the pool on huge pages", flush=True)
    best = {key: float("inf") for key in runs}
    for _ in range(reps):
        for key, setup_ in runs.items():
            best[key] = min(best[key], step(kernel, q, slots, setup_))
    for kv in kvs:
        off, on = 1000 * best[kv, False], 1000 * best[kv, True]
        print(f"{kv} b{batch} x 2K: 4K pages {off:.1f} ms, huge pages {on:.1f} ms "
              f"({on / off:.2f})", flush=True)


if __name__ == "__main__":
    main()
