"""A/B of decode-kernel builds on the same caches: each SOURCE_DIR (a copy of
slimkv/kernels, e.g. from `git show REV:slimkv/kernels/...`, optionally `DIR:-DFLAG`) is
built with the package's flags and timed in turn on one set of caches per KV dtype, the
best of REPS whole steps (all layers) kept: far steadier than separate runs on a shared
machine. Prints ms per 30-layer step and the largest difference from the first build.

    flock /tmp/slimkv-cpu.lock python scripts/attn_ab.py OLD_DIR,slimkv/kernels int8,int4 32 30 8 [runs]

A last argument `runs` lays each sequence's blocks out in order (as the engine's prefill
does) instead of anywhere in the pool.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attn_bench import BS, DIM, HEADS, KV_HEADS, LAYERS, setup  # noqa: E402

from slimkv.kernels import DecodeKernel, describe  # noqa: E402
from slimkv.kernels.build import FLAGS  # noqa: E402


def build(spec: str, out: Path) -> DecodeKernel:
    source, *extra = spec.split(":")
    subprocess.run(["gcc", *FLAGS, *extra, f"{source}/paged_decode.c", "-o", str(out), "-lm"],
                   check=True)
    return DecodeKernel(ctypes.CDLL(str(out)))


def main() -> None:
    specs, kvs = sys.argv[1].split(","), sys.argv[2].split(",")
    batch, layers, reps = (int(x) for x in sys.argv[3:6])
    tables_kind = sys.argv[6] if len(sys.argv) > 6 else "random"
    with tempfile.TemporaryDirectory() as tmp:
        kernels = [build(spec, Path(tmp) / f"k{i}.so") for i, spec in enumerate(specs)]
        for kv in kvs:
            cache, staging, tables, lens = setup(kv, batch, 2048, layers, tables_kind)
            sides = [tuple(describe(cache.layer_codecs[l][s], cache.layer_pool(s, l))
                           for s in "kv") for l in range(layers)]
            q, slots = torch.randn(batch, HEADS, DIM), torch.arange(batch)
            best, outs = [float("inf")] * len(kernels), []
            for rep in range(reps):
                for i, kernel in enumerate(kernels):
                    start = time.perf_counter()
                    for l in range(layers):
                        staged = None if staging is None else (*staging.layer_buffers(l), slots)
                        out = kernel(q, tables, lens, *sides[l], KV_HEADS, BS, DIM ** -0.5, staged)
                    best[i] = min(best[i], time.perf_counter() - start)
                    if rep == 0:
                        outs.append(out)
            diffs = [f"{float((o - outs[0]).abs().max()):.2g}" for o in outs]
            times = " ".join(f"{s}: {1000 * b * LAYERS / layers:.1f} ms"
                             for s, b in zip(specs, best))
            print(f"{kv} b{batch}: {times} (max diff vs first {diffs})", flush=True)


if __name__ == "__main__":
    main()
