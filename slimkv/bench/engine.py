"""``slimkv bench engine``: prefill and decode throughput of the engine per KV dtype."""

from __future__ import annotations

import platform
import time
from datetime import datetime, timezone
from typing import Any

import torch

from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.plugins import build_engine
from slimkv.engine.sampling import SamplingParams
from slimkv.workload import random_prompt, run_until_done


def measure_prefill(engine: LLMEngine, length: int) -> float:
    """Prompt tokens per second for one prompt of ``length`` tokens (chunked by the budget)."""
    prompt = random_prompt(length, engine.model_args.vocab_size, seed=length)
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    run_until_done(engine)
    return length / (time.perf_counter() - start)


def measure_decode(engine: LLMEngine, batch: int, context: int,
                   new_tokens: int) -> tuple[float, int | None]:
    """Generated tokens per second, all ``batch`` sequences decoding together at ``context``,
    and on CUDA the decode steps' peak allocated bytes beyond what was allocated before
    them (the pool, weights and staging: the steps' activations and workspace)."""
    params = SamplingParams(max_tokens=new_tokens + 1, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(random_prompt(context, engine.model_args.vocab_size, seed=i), params)
            for i in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):   # prefill everyone first
        engine.step()
    device = engine.runner.device
    if device.type == "cuda":   # the steps' own peak, above the pool, weights and staging
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    run_until_done(engine)
    rate = batch * new_tokens / (time.perf_counter() - start)
    if device.type == "cuda":
        return rate, torch.cuda.max_memory_allocated(device) - before
    return rate, None


def bench_engine(config: Config, kv_dtypes: list[str], prompt_lens: list[int],
                 batches: list[int], context: int, new_tokens: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for dtype in kv_dtypes:
        cfg = config.replace("kv_cache", dtype=dtype, k_dtype=None, v_dtype=None,
                             layer_dtypes=None, enable_prefix_caching=False, watermark=1.0,
                             max_concurrency_soft=max(batches))
        engine = build_engine(cfg)
        row: dict[str, Any] = {"bytes_per_token": engine.stats().bytes_per_token,
                               "memory": engine.memory_split(),
                               "decode_path": engine.runner.attention.decode_path}
        measure_prefill(engine, 16)  # warm-up
        for length in prompt_lens:
            row[f"prefill_{length}_tok_s"] = round(measure_prefill(engine, length), 1)
        for batch in batches:
            rate, peak = measure_decode(engine, batch, context, new_tokens)
            row[f"decode_b{batch}_ctx{context}_tok_s"] = round(rate, 1)
            if peak is not None:
                row[f"decode_b{batch}_ctx{context}_peak_step_bytes"] = peak
        print(f"{dtype:>9}: " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        results[dtype] = row
    return {"machine": machine_info(), "config": {
        "model_dtype": config.model.dtype, "block_size": config.kv_cache.block_size,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "context": context, "new_tokens": new_tokens}, "results": results}


ISA = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8"}


def machine_info() -> dict[str, Any]:
    """The CPU (model name and the ISA extensions our kernels and the peers care about)."""
    cpu, flags = platform.processor(), set()
    try:
        with open("/proc/cpuinfo") as f:
            info = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in f
                                                      if ":" in line)}
        cpu, flags = info.get("model name", cpu), set(info.get("flags", "").split())
    except OSError:
        pass
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {"cpu": cpu, "isa": sorted(flags & ISA), "torch_threads": torch.get_num_threads(),
            "gpu": gpu,
            "torch": torch.__version__,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}

