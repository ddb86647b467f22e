"""``slimkv bench capacity``: the case's experiment at this machine's scale.

One KV memory budget for every variant: the bytes that let the bfloat16 *contiguous*
engine admit ``sessions`` long sessions of ``context`` tokens under the configured
watermark (each contiguous request reserves ``max_model_len = context`` tokens). Each
variant (bf16 contiguous, then bf16/int8/fp8/int4 paged) is served from that budget by its
own ``slimkv serve`` process, and ``slimkv loadtest``'s closed loop sweeps concurrency
against it with the ``long-sessions`` workload while /metrics is sampled, so the server's
own running/waiting counts, KV blocks in use and preemptions sit beside the client's
latencies.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass
from typing import Any

import httpx

from slimkv.bench.engine import machine_info
from slimkv.bench.live import ServerLoad, ServerProcess, sample_metrics, scrape
from slimkv.config import Config
from slimkv.kv.cache import PagedKVCache
from slimkv.loadtest.cli import Progress
from slimkv.loadtest.report import summarize
from slimkv.loadtest.runner import RunSpec, run_level
from slimkv.loadtest.workloads import WorkloadSpec
from slimkv.model_io.loader import read_model_args
from slimkv.planner import bits_per_element
from slimkv.stats import cdiv

GiB = 1024 ** 3
DRAIN_TIMEOUT_S = 60.0


@dataclass(frozen=True, slots=True)
class Variant:
    dtype: str
    paged: bool

    @property
    def name(self) -> str:
        return f"{self.dtype} {'paged' if self.paged else 'contiguous'}"


VARIANTS = (Variant("bfloat16", False), Variant("bfloat16", True), Variant("int8", True),
            Variant("fp8", True), Variant("int4", True))


@dataclass(frozen=True, slots=True)
class CapacitySpec:
    context: int = 256
    doc_tokens: int = 128
    max_tokens: int = 16
    sessions: int = 24                # the contiguous bf16 baseline the budget is sized for
    levels: tuple[int, ...] = (8, 16, 24, 32, 48, 64)
    duration: float = 30.0
    memory_gb: float | None = None    # overrides the sized budget
    variants: tuple[Variant, ...] = VARIANTS
    seed: int = 0


def kv_shape(config: Config) -> dict[str, int]:
    args = read_model_args(config.model.path)
    return dict(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim)


def budget_bytes(config: Config, spec: CapacitySpec, shape: dict[str, int]) -> int:
    """Bytes of KV holding ``spec.sessions`` contiguous bf16 reservations below the watermark."""
    if spec.memory_gb is not None:
        return int(spec.memory_gb * GiB)
    kv = config.kv_cache
    reserve_blocks = cdiv(spec.context, kv.block_size)
    blocks = cdiv(spec.sessions * reserve_blocks * 1000, round(kv.watermark * 1000))
    per_token = PagedKVCache.bytes_per_token(**shape, k_dtype="bfloat16", v_dtype="bfloat16",
                                             k_scale=kv.k_scale, block_size=kv.block_size)
    return blocks * kv.block_size * per_token


def layout_bits(config: Config, shape: dict[str, int], context: int) -> float:
    """The stored bits per K/V element of a ``context``-token session in ``config``'s KV
    layout (its dtypes, ``k_scale``, ``int4.group_size``, ``layer_dtypes``): the bytes the
    engine itself sizes its pool by (:func:`slimkv.planner.bits_per_element`)."""
    kv = config.kv_cache
    return bits_per_element(context, **shape, k_dtype=kv.k_dtype or kv.dtype,
                            v_dtype=kv.v_dtype or kv.dtype, k_scale=kv.k_scale,
                            block_size=kv.block_size, layer_dtypes=kv.layer_dtypes,
                            int4_group_size=kv.int4.group_size)


def variant_config(config: Config, variant: Variant, budget: int, spec: CapacitySpec) -> Config:
    """The variant served from ``budget`` bytes, sized by the engine itself (blocks with their
    scales, and the staging blocks of schemes that need them, all inside the budget)."""
    return (config.replace("model", max_model_len=spec.context)
            .replace("kv_cache", dtype=variant.dtype, k_dtype=None, v_dtype=None,
                     layer_dtypes=None, paged=variant.paged, num_blocks=None,
                     memory_gb=budget / GiB))


async def measure_level(server: ServerProcess, run: RunSpec, concurrency: int,
                        progress: bool) -> dict[str, Any]:
    """One closed-loop level with /metrics sampled throughout, then wait for the drain."""
    load, stop = ServerLoad(), asyncio.Event()
    sampler = asyncio.create_task(sample_metrics(server.url, load, stop))
    bar = Progress(concurrency, run.duration, progress)
    level = await run_level(run, concurrency, bar)
    bar.close()
    stop.set()
    await sampler
    await _drain(server.url)
    return {**summarize(level), "server": load.summary()}


async def _drain(url: str) -> None:
    """Wait until the server runs and queues nothing, so levels do not overlap."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    async with httpx.AsyncClient(timeout=10) as http:
        while time.monotonic() < deadline:
            m = scrape((await http.get(f"{url}/metrics")).text)
            if not m["slimkv:num_requests_running"] and not m["slimkv:num_requests_waiting"]:
                return
            await asyncio.sleep(0.25)


def run_variant(config: Config, variant: Variant, spec: CapacitySpec, budget: int,
                progress: bool = True) -> dict[str, Any]:
    workload = WorkloadSpec("long-sessions", spec.context, spec.doc_tokens, spec.max_tokens,
                            seed=spec.seed)
    served = variant_config(config, variant, budget, spec)
    with ServerProcess(served) as server:
        run = RunSpec(server.url, server.model_name(), workload, spec.duration,
                      request_timeout=spec.duration + 30, extra_body={"ignore_eos": True})
        levels = []
        for concurrency in spec.levels:
            levels.append(asyncio.run(measure_level(server, run, concurrency, progress)))
            s = levels[-1]
            print(f"  {variant.name:>20} c={concurrency:<3} running<={s['server']['peak_running']:<3}"
                  f" waiting<={s['server']['peak_waiting']:<3} errors={s['error_count']}"
                  f" preemptions={s['server']['preemptions']} p99 TTFT={s['ttft_s']['p99']}",
                  flush=True)
    return {"variant": variant.name, "dtype": variant.dtype, "paged": variant.paged,
            "bits_per_element": layout_bits(served, kv_shape(config), spec.context),
            "levels": levels}


def bench_capacity(config: Config, spec: CapacitySpec, progress: bool = True) -> dict[str, Any]:
    shape = kv_shape(config)
    budget = budget_bytes(config, spec, shape)
    start = time.monotonic()
    results = [run_variant(config, v, spec, budget, progress) for v in spec.variants]
    return {"machine": machine_info(), "budget_bytes": budget,
            "spec": {**asdict(spec), "variants": [v.name for v in spec.variants]},
            "config": {"block_size": config.kv_cache.block_size,
                       "watermark": config.kv_cache.watermark,
                       "max_concurrency_soft": config.kv_cache.max_concurrency_soft,
                       "max_num_batched_tokens": config.scheduler.max_num_batched_tokens},
            "elapsed_s": round(time.monotonic() - start, 1), "variants": results}
