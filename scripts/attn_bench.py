"""Micro-benchmark of the fused decode kernel: ms per decode step's attention (all layers)
for B sequences x context tokens, per KV dtype, on SmolLM2-135M's shape (30 layers, 9 query
heads over 3 KV heads, head_dim 64, blocks of 16). Run under the CPU lock:

    flock /tmp/slimkv-cpu.lock python scripts/attn_bench.py [--batches 16 32] [--kv ...]
"""

from __future__ import annotations

import argparse
import time

import torch

from slimkv.kernels import decode_kernel, describe
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging

LAYERS, HEADS, KV_HEADS, DIM, BS = 30, 9, 3, 64, 16


def setup(kv: str, batch: int, context: int, layers: int, tables_kind: str = "random",
          v_kv: str | None = None):
    """tables_kind: "random" (blocks anywhere in the pool) or "runs" (each sequence's blocks
    in order, as an engine that prefilled them one after another lays them out). v_kv: the
    values' format when not kv's."""
    per_seq = -(-(context + 1) // BS)
    num_blocks = batch * per_seq + 1
    cache = PagedKVCache(num_layers=layers, num_blocks=num_blocks, block_size=BS,
                         num_kv_heads=KV_HEADS, head_dim=DIM, k_dtype=kv, v_dtype=v_kv or kv,
                         k_scale="per_channel_block", device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    outlier = 1 + 4 * (torch.rand(KV_HEADS, DIM, generator=gen) > 0.9)
    for start in range(0, num_blocks, 512):
        ids = torch.arange(start, min(start + 512, num_blocks))
        k = torch.randn(len(ids), BS, KV_HEADS, DIM, generator=gen) * outlier
        v = torch.randn(len(ids), BS, KV_HEADS, DIM, generator=gen)
        cache.write_blocks(0, ids, k, v)
    for t in cache.tensors().values():
        t[1:] = t[0]
    staging = Staging(cache, batch, torch.bfloat16) if cache.block_scaled else None
    if staging is not None:
        staging.buffer.normal_(generator=gen)
    perm = torch.randperm(num_blocks - 1, generator=gen) + 1
    if tables_kind == "runs":
        perm = torch.arange(1, num_blocks)
    tables = perm[:batch * per_seq].view(batch, per_seq).contiguous()
    lens = torch.full((batch,), context + 1, dtype=torch.long)
    return cache, staging, tables, lens


def bench(kv: str, batch: int, context: int, layers: int, steps: int) -> float:
    cache, staging, tables, lens = setup(kv, batch, context, layers)
    sides = [tuple(describe(cache.layer_codecs[l][s], cache.layer_pool(s, l)) for s in "kv")
             for l in range(layers)]
    kernel = decode_kernel()
    q = torch.randn(batch, HEADS, DIM)
    slots = torch.arange(batch)

    def step() -> None:
        for l in range(layers):
            staged = None if staging is None else (*staging.layer_buffers(l), slots)
            kernel(q, tables, lens, *sides[l], KV_HEADS, BS, DIM ** -0.5, staged)

    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 32])
    parser.add_argument("--kv", nargs="+", default=["bfloat16", "int8", "int4"])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}")
    for batch in args.batches:
        ms = {kv: bench(kv, batch, args.context, args.layers, args.steps) for kv in args.kv}
        line = " ".join(f"{kv} {t:.2f} ms" for kv, t in ms.items())
        ratios = ""
        if "bfloat16" in ms and "int8" in ms:
            ratios += f" int8/bf16 {ms['int8'] / ms['bfloat16']:.3f}"
        if "int8" in ms and "int4" in ms:
            ratios += f" int4/int8 {ms['int4'] / ms['int8']:.3f}"
        print(f"b{batch} x {args.context}: {line}{ratios}", flush=True)


if __name__ == "__main__":
    main()
