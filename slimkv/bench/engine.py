"""``slimkv bench engine``: prefill and decode throughput of the engine per KV dtype."""

from __future__ import annotations

import gc
import platform
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

from slimkv.bench.decode_window import (DecodeWindow, decode_window, prefill_all,
                                        prefill_steps_bound)
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
                   new_tokens: int) -> tuple[DecodeWindow, int | None]:
    """Generated tokens per second over up to ``new_tokens`` steps in which all ``batch``
    sequences decode together at ``context`` (:mod:`slimkv.bench.decode_window`: after the
    last prefill step, before the first sequence finishes), and on CUDA those steps' peak
    allocated bytes beyond what was allocated before them (the pool, weights and staging:
    the steps' activations and workspace). The sequences are aborted after the window."""
    budget = engine.config.scheduler.max_num_batched_tokens
    # Room for the tokens the first-prefilled sequences decode while the others prefill.
    params = SamplingParams(max_tokens=new_tokens + prefill_steps_bound(batch, context, budget),
                            temperature=0, ignore_eos=True)
    seqs = [engine.add_request(random_prompt(context, engine.model_args.vocab_size, seed=i), params)
            for i in range(batch)]
    prefill_all(engine, seqs)
    device = engine.runner.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    if device.type == "cuda":   # the steps' own peak, above the pool, weights and staging
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    window = decode_window(engine, seqs, new_tokens, sync)
    peak = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    for seq in seqs:
        engine.abort_request(seq.parent_id)
    run_until_done(engine)
    return window, peak


def measure_dtype(cfg: Config, prompt_lens: list[int], batches: list[int], context: int,
                  new_tokens: int) -> dict[str, Any]:
    """One KV dtype's row; the engine lives only in here, so it is freed on return."""
    engine = build_engine(cfg)
    row: dict[str, Any] = {"bytes_per_token": engine.stats().bytes_per_token,
                           "memory": engine.memory_split(),
                           "decode_path": engine.runner.attention.decode_path}
    measure_prefill(engine, 16)  # warm-up
    for length in prompt_lens:
        row[f"prefill_{length}_tok_s"] = round(measure_prefill(engine, length), 1)
    for batch in batches:
        window, peak = measure_decode(engine, batch, context, new_tokens)
        key = f"decode_b{batch}_ctx{context}"
        row[f"{key}_tok_s"] = None if window.tok_s is None else round(window.tok_s, 1)
        row[f"{key}_steps"] = window.steps  # full-batch decode steps timed
        if peak is not None:
            row[f"{key}_peak_step_bytes"] = peak
    return row


def free_device_memory() -> None:
    """Collect a dropped engine (cycles too) and hand its cached blocks back to the device,
    so that the next engine's pool, sized from free memory, gets the whole card."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def bench_engine(config: Config, kv_dtypes: list[str], prompt_lens: list[int],
                 batches: list[int], context: int, new_tokens: int,
                 on_result: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every KV dtype in turn, one engine at a time; ``on_result`` gets the result so far
    after each (a dtype that fails is recorded with its error, and the next still runs)."""
    result: dict[str, Any] = {"machine": machine_info(), "config": {
        "model_dtype": config.model.dtype, "block_size": config.kv_cache.block_size,
        "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        "context": context, "new_tokens": new_tokens,
        "decode_window": "full-batch decode steps only"}, "results": {}}
    for dtype in kv_dtypes:
        cfg = config.replace("kv_cache", dtype=dtype, k_dtype=None, v_dtype=None,
                             layer_dtypes=None, enable_prefix_caching=False, watermark=1.0,
                             max_concurrency_soft=max(batches))
        try:
            row = measure_dtype(cfg, prompt_lens, batches, context, new_tokens)
        except Exception as e:  # noqa: BLE001 - a lent GPU runs once: keep the other dtypes
            traceback.print_exc()
            row = {"error": f"{type(e).__name__}: {e}"}
        free_device_memory()
        print(f"{dtype:>9}: " + ", ".join(f"{k}={v}" for k, v in row.items()), flush=True)
        result["results"][dtype] = row
        if on_result is not None:
            on_result(result)
    return result


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

