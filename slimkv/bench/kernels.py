"""``slimkv bench kernels``: the native kernels' speed on this host, in one JSON.

Every part is measured on random data at SmolLM2-135M's shapes (30 layers, hidden 576,
FFN 1536, 9 query heads over 3 KV heads of 64, blocks of 16), in the model dtype
``model.dtype: auto`` picks here unless ``--dtype`` names one; what a part compares is
timed in turn (:func:`slimkv.bench.timing.interleaved`), best and median kept:

- ``decode``: the fused paged decode attention kernel, one decode step (every layer) for
  ``B`` sequences x ``context`` tokens per KV dtype (``K/V``, e.g. ``int4/int8``, mixes
  them), each sequence's blocks in order in the pool (as prefill lays them out; ``--tables
  random`` scatters them), the last block staged where the keys have block scales; with
  the KV bytes a step reads and the rate that makes.
- ``gemm``: one decode step's weight matmuls (each layer's Q4_1 QKV / O / gate-up / down,
  the Q8_0 ``--vocab`` (49,152) x 576 head) at M rows: the int8 kernel, its precise mode
  (int8 + int8 residual), dequantize + float GEMM, float-resident weights; kernel modes up
  to ``--kernel-rows`` (the engine's limit), plus dequantizing every weight once.
- ``prefill``: one layer's attention of a ``--prefill-tokens`` chunk, the chunk that starts
  a sequence (one causal call) and the same chunk on a staged cache (pieces over pool and
  staged keys under masks): the prefill kernel against torch's SDPA, largest difference.
- ``rows``: one layer's four prefill projections (float GEMMs) at every row count from
  ``--kernel-rows`` + 1 to ``--prefill-tokens``, rows exact (``F.linear``) against rows in
  buckets (:func:`slimkv.model.gemm.linear`): the first sweep of each (bucketed first: its
  shapes are a subset) with the resident memory it added (the JIT kernels oneDNN keeps per
  shape, on a CPU with native bf16), then warm sweeps of both in turn, over every count
  and over every 8th (few enough shapes that oneDNN's cache holds the exact ones too: what
  the padding alone costs).
- ``memory``: the host's streaming rate with torch's threads (a float32 buffer summed,
  then reduced by max): the ceiling of a kernel that only waits on its reads.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from slimkv.attention import prefill
from slimkv.bench.soak_server import rss_bytes
from slimkv.bench.timing import environment, interleaved, ms_of, summary
from slimkv.backends import cpu_prefill
from slimkv.backends.cpu_decode import decode_kernel, describe
from slimkv.kernels.prefill_attn import prefill_kernel
from slimkv.kernels.qgemm import PLAIN, PRECISE, pack, qgemm_kernel
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import StagedKV, Staging
from slimkv.model.gemm import bucket_rows, linear

LAYERS, HEADS, KV_HEADS, DIM, BS = 30, 9, 3, 64, 16
HIDDEN, FFN, VOCAB = 576, 1536, 49152
SHAPES = [(960, HIDDEN, 4), (HIDDEN, HIDDEN, 4), (2 * FFN, HIDDEN, 4), (HIDDEN, FFN, 4)]
PARTS = ("decode", "gemm", "prefill", "rows", "memory")
CPU = torch.device("cpu")


def decode_setup(kv: str, batch: int, context: int, layers: int, dtype: torch.dtype,
                 tables: str = "runs") -> tuple[Callable[[Any], Tensor], int]:
    """A pool of ``batch`` sequences x ``context`` tokens (``kv``: a dtype, or ``K/V``)
    and ``step(kernel) -> out``, one decode step's attention over every layer (the last
    layer's output returned); with the KV bytes a step reads."""
    k_kv, _, v_kv = kv.partition("/")
    per_seq = -(-(context + 1) // BS)
    num_blocks = batch * per_seq + 1
    cache = PagedKVCache(num_layers=layers, num_blocks=num_blocks, block_size=BS,
                         num_kv_heads=KV_HEADS, head_dim=DIM, k_dtype=k_kv, v_dtype=v_kv or k_kv,
                         k_scale="per_channel_block", device=CPU)
    gen = torch.Generator().manual_seed(0)
    outlier = 1 + 4 * (torch.rand(KV_HEADS, DIM, generator=gen) > 0.9)  # outlier channels
    for start in range(0, num_blocks, 512):
        ids = torch.arange(start, min(start + 512, num_blocks))
        k = torch.randn(len(ids), BS, KV_HEADS, DIM, generator=gen) * outlier
        cache.write_blocks(0, ids, k, torch.randn(len(ids), BS, KV_HEADS, DIM, generator=gen))
    for t in cache.tensors().values():
        t[1:] = t[0]  # every layer a copy of the first
    staging = Staging(cache, batch, dtype) if cache.block_scaled else None
    if staging is not None:
        staging.buffer.normal_(generator=gen)
    order = (torch.arange(1, num_blocks) if tables == "runs"
             else torch.randperm(num_blocks - 1, generator=gen) + 1)
    block_tables = order[:batch * per_seq].view(batch, per_seq).contiguous()
    lens = torch.full((batch,), context + 1, dtype=torch.long)
    sides = [tuple(describe(cache.layer_codecs[l][s], cache.layer_pool(s, l)) for s in "kv")
             for l in range(layers)]
    q, slots = torch.randn(batch, HEADS, DIM, generator=gen), torch.arange(batch)

    def step(kernel) -> Tensor:
        for l in range(layers):
            staged = None if staging is None else (*staging.layer_buffers(l), slots)
            out = kernel(q, block_tables, lens, *sides[l], KV_HEADS, BS, DIM ** -0.5, staged)
        return out
    return step, cache.bytes_per_block * batch * (context + 1) // BS


def bench_decode(kvs: list[str], batches: list[int], context: int, layers: int,
                 dtype: torch.dtype, tables: str, reps: int) -> dict[str, Any]:
    kernel = decode_kernel()
    if kernel is None:
        return {"skipped": "no decode kernel (see machine.kernels_missing)"}
    out: dict[str, Any] = {}
    for batch in batches:
        steps = {kv: decode_setup(kv, batch, context, layers, dtype, tables) for kv in kvs}
        runs = interleaved({kv: lambda s=s: s(kernel) for kv, (s, _) in steps.items()}, reps)
        for kv, (_, nbytes) in steps.items():
            row = summary(runs[kv])
            row["kv_bytes"] = nbytes
            row["kv_gb_s"] = float(f"{nbytes / min(runs[kv]) / 1e6:.4g}")
            out[f"b{batch}/{kv}"] = row
    return out


def bench_gemm(rows: list[int], layers: int, dtype: torch.dtype, kernel_rows: int,
               reps: int, vocab: int = VOCAB) -> dict[str, Any]:
    kernel = qgemm_kernel()
    if kernel is None:
        return {"skipped": "no qgemm kernel (see machine.kernels_missing)"}
    gen = torch.Generator().manual_seed(0)
    shapes = [s for _ in range(layers) for s in SHAPES] + [(vocab, HIDDEN, 8)]
    packed = [(random_packed(n, k, bits, gen), n, k) for n, k, bits in shapes]
    resident = [torch.randn(n, k, generator=gen).to(dtype) for n, k, _ in shapes]
    x = {k: torch.randn(max(rows), k, generator=gen) for k in (HIDDEN, FFN)}

    def kernel_step(m: int, mode: int) -> None:
        for p, n, k in packed:
            kernel(x[k][:m], p, n, mode=mode)

    def dequantize() -> list[Tensor]:
        return [kernel.dequantize(p, n, dtype) for p, n, _ in packed]

    def dequant_gemm(m: int) -> None:
        for (p, n, k), w in zip(packed, dequantize()):
            F.linear(x[k][:m].to(dtype), w)

    def resident_gemm(m: int) -> None:
        for w in resident:
            F.linear(x[w.shape[1]][:m].to(dtype), w)

    out: dict[str, Any] = {"dequantize_all": summary(interleaved({"d": dequantize}, reps)["d"])}
    for m in rows:
        fns = {"dequant_gemm": lambda: dequant_gemm(m), "resident_gemm": lambda: resident_gemm(m)}
        if m <= kernel_rows:
            fns = {"int8_kernel": lambda: kernel_step(m, PLAIN),
                   "precise_kernel": lambda: kernel_step(m, PLAIN | PRECISE), **fns}
        out[f"rows{m}"] = {name: summary(r) for name, r in interleaved(fns, reps).items()}
    return out


def random_packed(n: int, k: int, bits: int, gen: torch.Generator) -> Tensor:
    """A ``[n, k]`` weight of random ``bits``-bit codes in :func:`pack`'s layout."""
    d = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    q = torch.randint(0, 256, (n, k * bits // 8), dtype=torch.uint8, generator=gen)
    return pack(q, d, -8 * d, bits)


@contextlib.contextmanager
def prefill_kernel_as(kernel: Any) -> Iterator[None]:
    """:mod:`slimkv.attention.prefill` calling ``kernel`` (None: torch's SDPA) inside."""
    real = prefill.prefill_kernel
    prefill.prefill_kernel = lambda: kernel
    try:
        yield
    finally:
        prefill.prefill_kernel = real


def prefill_cases(tokens: int, dtype: torch.dtype) -> dict[str, Callable[[Any], Tensor]]:
    """``case -> run(kernel)``: one layer's attention of a ``tokens`` chunk through
    :func:`slimkv.attention.prefill.run` with ``kernel`` (None: SDPA). ``causal``: the
    chunk that starts an unstaged sequence; ``staged``: the same chunk of a staged cache
    piece by piece; ``staged_one_call``: the same in the engine's one kernel call for all
    pieces (:func:`slimkv.backends.cpu_prefill.one_call`; SDPA's pieces where it does not
    take them, e.g. ``kernel`` None; older builds' one call read masks:
    :func:`slimkv.bench.ab.ab_builds` skips this case for them)."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, h, DIM, generator=gen).to(dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    staged, pieces = StagedKV(0, k, v), tuple(prefill.plan(tokens, tokens, 0, BS, dtype, CPU))
    cases = {"causal": (prefill.plan(tokens, tokens, None, BS, dtype, CPU), None, False),
             "staged": (pieces, staged, False), "staged_one_call": (pieces, staged, True)}

    def runner(pieces, staged, one_call) -> Callable[[Any], Tensor]:
        def run(kernel) -> Tensor:
            with prefill_kernel_as(kernel):
                out = cpu_prefill.one_call(q, k, v, staged, pieces, 0, BS,
                                           DIM ** -0.5) if one_call else None
                return prefill.run(pieces, q, k, v, staged, DIM ** -0.5) if out is None else out
        return run
    return {case: runner(*c) for case, c in cases.items()}


def bench_prefill(tokens: int, dtype: torch.dtype, reps: int) -> dict[str, Any]:
    kernel = prefill_kernel() if dtype == torch.bfloat16 else None  # the kernel's only dtype
    out: dict[str, Any] = {} if kernel else {"kernel_skipped": "none here, or not bf16"}
    for case, run in prefill_cases(tokens, dtype).items():
        fns = {"sdpa": lambda run=run: run(None)}
        if kernel is not None:
            fns["kernel"] = lambda run=run: run(kernel)
        out[case] = {name: summary(r) for name, r in interleaved(fns, reps).items()}
        if kernel is not None:
            diff = (fns["kernel"]().float() - fns["sdpa"]().float()).abs().max()
            out[case]["max_abs_diff"] = float(diff)
            out[case]["kernel_over_sdpa"] = round(out[case]["kernel"]["median_ms"]
                                                  / out[case]["sdpa"]["median_ms"], 4)
    return out


def bench_rows(low: int, high: int, dtype: torch.dtype, reps: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen).to(dtype) for n, k, _ in SHAPES]
    x = {k: torch.randn(high, k, generator=gen).to(dtype) for k in (HIDDEN, FFN)}
    ways = {"bucketed": linear, "exact": F.linear}

    def sweep(fn: Callable[..., Tensor], counts: range) -> None:
        for m in counts:
            for w in weights:
                fn(x[w.shape[1]][:m], w)

    every, sparse = range(low, high + 1), range(low, high + 1, 8)
    out: dict[str, Any] = {"rows": [low, high]}
    for name, fn in ways.items():
        before = rss_bytes(os.getpid())
        ms = ms_of(lambda: sweep(fn, every))
        out[name] = {"shapes": len(weights) * len({m if fn is F.linear else bucket_rows(m)
                                                   for m in every}),
                     "first_sweep_ms": round(ms, 1),
                     "rss_growth_mib": round((rss_bytes(os.getpid()) - before) / 2**20, 1)}
    # Every count (more shapes than oneDNN's cache holds), then every 8th (both cached).
    for key, counts in (("warm_sweep", every), ("warm_sweep_every_8th", sparse)):
        warm = interleaved({name: lambda fn=fn: sweep(fn, counts)
                            for name, fn in ways.items()}, reps)
        for name, runs in warm.items():
            out[name][key] = summary(runs)
    return out


def bench_memory(mib: int, reps: int) -> dict[str, Any]:
    x = torch.ones(mib << 18, dtype=torch.float32)  # mib MiB of float32
    runs = interleaved({"sum": lambda: torch.sum(x), "max": lambda: torch.max(x)}, reps)
    return {"buffer_mib": mib, **{f"{op}_gb_s": float(f"{x.nbytes / min(r) / 1e6:.4g}")
                                  for op, r in runs.items()}}


def bench_kernels(parts: list[str], kvs: list[str], batches: list[int], context: int,
                  layers: int, rows: list[int], kernel_rows: int, prefill_tokens: int,
                  mem_mib: int, reps: int, dtype: torch.dtype | None = None,
                  tables: str = "runs", vocab: int = VOCAB) -> dict[str, Any]:
    """Every part in ``parts`` (:data:`PARTS`); see the module doc. The decode and gemm
    parts time ``layers`` layers (the model's :data:`LAYERS` by default)."""
    env = environment(dtype)
    dtype = getattr(torch, env["dtype"])
    result: dict[str, Any] = {"machine": env, "setup": {
        "parts": parts, "reps": reps, "layers": layers,
        "heads": HEADS, "kv_heads": KV_HEADS, "head_dim": DIM, "block_size": BS,
        "context": context, "batches": batches, "kv_dtypes": kvs, "tables": tables,
        "rows": rows, "kernel_rows": kernel_rows, "vocab": vocab, "prefill_tokens": prefill_tokens,
        "torch_threads": torch.get_num_threads()}}
    runs = {"decode": lambda: bench_decode(kvs, batches, context, layers, dtype, tables, reps),
            "gemm": lambda: bench_gemm(rows, layers, dtype, kernel_rows, reps, vocab),
            "prefill": lambda: bench_prefill(prefill_tokens, dtype, reps),
            "rows": lambda: bench_rows(kernel_rows + 1, prefill_tokens, dtype, reps),
            "memory": lambda: bench_memory(mem_mib, reps)}
    for part in parts:
        result[part] = runs[part]()
        print(f"{part}: {brief(result[part])}", flush=True)
    return result


def brief(part: dict[str, Any]) -> str:
    """One line per part: each entry's median ms (nested a level), or its rate."""
    def one(v: Any) -> str:
        if isinstance(v, dict) and "median_ms" in v:
            return f"{v['median_ms']:.3g} ms"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} {one(x)}" for k, x in v.items()
                                   if isinstance(x, dict)) + "}"
        return str(v)
    return ", ".join(f"{k} {one(v)}" for k, v in part.items())
