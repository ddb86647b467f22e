"""``slimkv bench compare``: slimkv and its peers on the same workloads, in one run.

Workloads (the performance issue's): batched throughput, 16 prompts x 512 random tokens +
64 new tokens, greedy (vLLM-CPU's driver runs the same); decode step time with 16 and 32
sequences at 2K-token contexts per KV dtype (the bandwidth effect of quantized KV);
8 sequences with 16-token prompts decoding 128 tokens together, single-stream decode at 16
and 2,048 tokens of context, and prefill of 512 / 2,048 tokens (llama.cpp's driver runs the
same). slimkv runs in this process; peers run in their own venvs (:mod:`slimkv.bench.peers`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import Any

from slimkv.bench.compare_report import TARGETS, ratios, verdicts, vllm_8bit_basis
from slimkv.bench.engine import machine_info
from slimkv.bench.peers import Peers
from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.plugins import build_engine
from slimkv.engine.sampling import SamplingParams
from slimkv.workload import random_prompt, run_until_done

BATCHES = [16, 32]  # concurrent sequences of the decode-step workload
VLLM_KV = {"bfloat16": "auto", "int8": "fp8"}  # slimkv KV dtype -> vLLM-CPU's in the ratio


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def engine_for(config: Config, kv_dtype: str, max_seqs: int, max_tokens: int) -> LLMEngine:
    """An engine with a pool for ``max_seqs`` sequences of ``max_tokens``, no prefix reuse,
    first-come-first-served (raw throughput: no lane holds long requests back)."""
    blocks = max_seqs * math.ceil(max_tokens / config.kv_cache.block_size) + 16
    config = config.replace("kv_cache", dtype=kv_dtype, k_dtype=None, v_dtype=None,
                            num_blocks=blocks, enable_prefix_caching=False, watermark=1.0,
                            max_concurrency_soft=max_seqs)
    return build_engine(config.replace("scheduler", policy="fcfs"))


def batched(engine: LLMEngine, prompts: int, prompt_len: int, new_tokens: int) -> dict[str, Any]:
    """vLLM's workload: all prompts submitted at once, wall time to the last token."""
    vocab = engine.model_args.vocab_size
    start = time.perf_counter()
    for i in range(prompts):
        engine.add_request(random_prompt(prompt_len, vocab, seed=1000 + i), greedy(new_tokens))
    run_until_done(engine)
    wall = time.perf_counter() - start
    return {"wall_s": round(wall, 3), "output_tok_s": round(prompts * new_tokens / wall, 2),
            "total_tok_s": round(prompts * (prompt_len + new_tokens) / wall, 2)}


def decode_budget(engine_or_chunk: LLMEngine | int, batches: list[int], context: int,
                  steps: int) -> int:
    """New tokens each sequence of :func:`decode_steps` may generate: the ones it decodes
    while the others still prefill (chunked prefill; decodes share each step's token budget,
    so at most twice the chunks' count of steps), plus every measured step."""
    chunk = (engine_or_chunk if isinstance(engine_or_chunk, int)
             else engine_or_chunk.config.scheduler.max_num_batched_tokens)
    return 2 * max(batches) * math.ceil(context / chunk) + len(batches) * (steps + 1) + 1


def take_turns(reps: int, measures: dict[str, Callable[[int], Any]]) -> dict[str, list[Any]]:
    """``reps`` rounds in which every measure runs once, in order (``measure(rep)``): this
    machine's speed drifts between minutes, so a ratio of two sides is only fair when their
    runs interleave."""
    runs: dict[str, list[Any]] = {name: [] for name in measures}
    for rep in range(reps):
        for name, measure in measures.items():
            runs[name].append(measure(rep))
    return runs


def timed_steps(engine: LLMEngine, steps: int) -> float:
    """Mean ms per ``engine.step()`` over ``steps`` steps."""
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return round(1000 * (time.perf_counter() - start) / steps, 2)


def decode_steps(engines: dict[str, LLMEngine], batches: list[int], context: int, steps: int,
                 reps: int = 1) -> dict[str, dict[str, Any]]:
    """Ms per decode step with ``b`` sequences at ``context`` tokens, for each ``b`` in
    ``batches`` (largest first: its sequences are prefilled once, then cut down) and each
    engine: the median of ``reps`` runs of ``steps`` steps, the engines taking turns."""
    seqs = {}
    for name, engine in engines.items():
        budget = greedy(decode_budget(engine, batches, context, steps * reps))
        vocab = engine.model_args.vocab_size
        seqs[name] = [engine.add_request(random_prompt(context, vocab, seed=i), budget)
                      for i in range(max(batches))]
        while any(s.num_output_tokens == 0 for s in seqs[name]):
            engine.step()
    result: dict[str, dict[str, Any]] = {name: {} for name in engines}
    for batch in sorted(batches, reverse=True):
        for name, engine in engines.items():
            for seq in seqs[name][batch:]:
                engine.abort_request(seq.request_id)
            engine.step()  # warm-up at this batch size
        runs = take_turns(reps, {name: lambda rep, e=engine: timed_steps(e, steps)
                                 for name, engine in engines.items()})
        for name, ms in runs.items():
            if any(seq.is_finished for seq in seqs[name][:batch]):
                raise RuntimeError("a sequence finished inside the measured decode steps")
            result[name][f"b{batch}"] = round(statistics.median(ms), 2)
            result[name][f"b{batch}_runs"] = ms
    for name, engine in engines.items():
        for seq in seqs[name]:
            engine.abort_request(seq.request_id)
    return result


def decode_rate(engine: LLMEngine, num_seqs: int, prompt_len: int, new_tokens: int) -> float:
    """Aggregate generated tokens/s of ``num_seqs`` sequences decoding together, after their
    prefill (llama.cpp's parallel and single-stream decode)."""
    vocab = engine.model_args.vocab_size
    seqs = [engine.add_request(random_prompt(prompt_len, vocab, seed=50 + i),
                               greedy(new_tokens + 1)) for i in range(num_seqs)]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    start = time.perf_counter()
    run_until_done(engine)
    return round(num_seqs * new_tokens / (time.perf_counter() - start), 2)


def prefill_rate(engine: LLMEngine, length: int, seed: int = 0) -> float:
    start = time.perf_counter()
    engine.add_request(random_prompt(length, engine.model_args.vocab_size, seed=length + seed),
                       greedy(1))
    run_until_done(engine)
    return round(length / (time.perf_counter() - start), 2)


def median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every number over ``runs``, every run kept; a side skipped in every run
    keeps its first reason."""
    done = [run for run in runs if "skipped" not in run]
    if not done:
        return runs[0]
    keys = [k for k, v in done[0].items() if isinstance(v, (int, float))]
    return {**{k: round(statistics.median(run[k] for run in done), 3) for k in keys},
            "runs": runs}


def batched_rows(engines: dict[str, LLMEngine], peers: Peers | None, reps: int
                 ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The batched workload on each engine and on vLLM-CPU with the paired KV dtype
    (:data:`VLLM_KV`), all taking turns ``reps`` times: (slimkv rows, vLLM rows)."""
    measures: dict[str, Callable[[int], dict[str, Any]]] = {}
    for kv, engine in engines.items():
        measures[kv] = lambda rep, e=engine: batched(e, 16, 512, 64)
        if peers is not None and kv in VLLM_KV:
            measures[f"vllm {VLLM_KV[kv]}"] = (lambda rep, peer_kv=VLLM_KV[kv]:
                                              peers.vllm(peer_kv, 16, 512, 64))
    runs = take_turns(reps, measures)
    for name, row in runs.items():
        print(f"batched {name}: {[r.get('skipped') or r['total_tok_s'] for r in row]}",
              flush=True)
    return ({kv: median_row(runs[kv]) for kv in engines},
            {k.split()[1]: median_row(v) for k, v in runs.items() if k.startswith("vllm ")})


def llamacpp_rows(engines: dict[str, LLMEngine], reps: int) -> dict[str, dict[str, Any]]:
    """The rows compared with llama.cpp for each engine, each the median of ``reps`` runs,
    the engines taking turns run by run as in the batched and decode-step rows: the int8 /
    bf16 KV ratios of these rows are only fair when their runs interleave (fresh prompts for
    prefill: no prefix hit)."""
    rows = {"parallel8_tok_s": lambda e, r: decode_rate(e, 8, 16, 128),
            "decode_d16_tok_s": lambda e, r: decode_rate(e, 1, 16, 128),
            "decode_d2048_tok_s": lambda e, r: decode_rate(e, 1, 2048, 128),
            "prefill_512_tok_s": lambda e, r: prefill_rate(e, 512, 7919 * r),
            "prefill_2048_tok_s": lambda e, r: prefill_rate(e, 2048, 7919 * r)}
    result: dict[str, dict[str, Any]] = {kv: {} for kv in engines}
    for row, measure in rows.items():
        runs = take_turns(reps, {kv: lambda rep, e=engine, m=measure: m(e, rep)
                                 for kv, engine in engines.items()})
        for kv, values in runs.items():
            result[kv][row] = round(statistics.median(values), 2)
    return result


def bench_slimkv(config: Config, kv_dtypes: list[str], peers: Peers | None, reps: int,
                 context: int, steps: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every workload on one engine per KV dtype, all engines alive at once so that the
    batched and decode-step rows (compared across dtypes and with vLLM) interleave:
    (slimkv rows per dtype, vLLM rows per its KV dtype)."""
    chunk = config.scheduler.max_num_batched_tokens
    tokens = context + decode_budget(chunk, BATCHES, context, steps * reps) + 16
    engines = {kv: engine_for(config, kv, max(BATCHES), tokens) for kv in kv_dtypes}
    for engine in engines.values():
        prefill_rate(engine, 16)  # warm-up: kernels built, allocator primed
    slim, vllm = batched_rows(engines, peers, reps)
    step = decode_steps(engines, BATCHES, context, steps, reps)
    rows = llamacpp_rows(engines, reps)
    for kv, engine in engines.items():
        slim[kv] = {"batched_16x512_64": slim[kv], "decode_step_ms_ctx2048": step[kv],
                    **rows[kv],
                    "decode_path": dict(engine.stats().attention_paths),
                    "weights": engine.runner.weights_class,
                    "model_dtype": str(engine.runner.dtype)}
        print(f"slimkv {kv}: {slim[kv]}", flush=True)
    return slim, vllm


def bench_compare(config: Config, kv_dtypes: list[str], peers: Peers | None, reps: int,
                  context: int = 2048, steps: int = 16) -> dict[str, Any]:
    slim, vllm = bench_slimkv(config, kv_dtypes, peers, reps, context, steps)
    llama: dict[str, Any] = {}
    if peers is not None:
        llama = peers.llamacpp(reps)
        print(f"llama.cpp: {llama.get('skipped') or 'done'}", flush=True)
    values = ratios(slim, vllm, llama)
    return {"machine": machine_info(), "model_dtype": config.model.dtype,
            "workloads": {"batched": "16 prompts x 512 random tokens + 64 new, greedy",
                          "decode_step": f"ms/step: median of {reps} runs of {steps} steps, "
                                             f"contexts {context}, dtypes in turn",
                          "parallel8": "8 seqs, 16-token prompts, 128 new tokens each",
                          "single": "1 seq, 128 new tokens after 16 / 2048 prompt tokens"},
            "slimkv": slim, "vllm_cpu": vllm, "llamacpp": llama, "ratios": values,
            "vllm_kv_for_8bit_row": vllm_8bit_basis(vllm),
            "targets": {k: {"target": t, "higher_is_better": h} for k, (t, h) in TARGETS.items()},
            "verdicts": verdicts(values)}
