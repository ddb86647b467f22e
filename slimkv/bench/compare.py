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

from slimkv.bench.engine import machine_info
from slimkv.bench.peers import Peers
from slimkv.config import Config
from slimkv.engine import LLMEngine
from slimkv.plugins import build_engine
from slimkv.sampling import SamplingParams
from slimkv.workload import random_prompt, run_until_done

# Ratio -> (target, True when higher is better), as the issue states them.
TARGETS = {  # issue 15's targets
    "batched_bf16_kv_vs_vllm": (1.5, True), "batched_8bit_kv_vs_vllm": (1.5, True),
    "step_int8_over_bf16_b16": (0.8, False), "step_int8_over_bf16_b32": (0.8, False),
    "step_int4_over_int8_b16": (1.0, False), "step_int4_over_int8_b32": (1.0, False),
    "parallel8_vs_llamacpp": (1.25, True), "single_decode_d16_vs_llamacpp": (0.8, True),
    "single_decode_d2048_vs_llamacpp": (1.0, True), "prefill_512_vs_llamacpp": (1.5, True),
    "prefill_2048_vs_llamacpp": (1.5, True),
}
LLAMACPP_KV = "f16"  # llama.cpp's default KV type, flash attention on
BATCHES = [16, 32]  # concurrent sequences of the decode-step workload


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


def decode_steps(engine: LLMEngine, batches: list[int], context: int,
                 steps: int) -> dict[str, float]:
    """Mean ms per decode step with ``b`` sequences at ``context`` tokens, for each ``b`` in
    ``batches`` (largest first: its sequences are prefilled once, then cut down)."""
    vocab = engine.model_args.vocab_size
    budget = greedy(decode_budget(engine, batches, context, steps))
    seqs = [engine.add_request(random_prompt(context, vocab, seed=i), budget)
            for i in range(max(batches))]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    result = {}
    for batch in sorted(batches, reverse=True):
        for seq in seqs[batch:]:
            engine.abort_request(seq.request_id)
        engine.step()  # warm-up at this batch size
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        result[f"b{batch}"] = round(1000 * (time.perf_counter() - start) / steps, 2)
        if any(seq.is_finished for seq in seqs[:batch]):
            raise RuntimeError("a sequence finished inside the measured decode steps")
    for seq in seqs:
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


def median_of(reps: int, measure: Callable[[int], float]) -> float:
    """The median of ``reps`` measurements (``measure(rep)``), as llama.cpp's rows are."""
    return round(statistics.median(measure(rep) for rep in range(reps)), 2)


def bench_slimkv(config: Config, kv_dtypes: list[str], context: int, steps: int,
                 progress: bool = True, reps: int = 1) -> dict[str, Any]:
    """Every workload for each KV dtype, one engine per dtype; the rows compared with
    llama.cpp are the median of ``reps`` runs (fresh prompts for prefill: no prefix hit)."""
    out: dict[str, Any] = {}
    for kv in kv_dtypes:
        budget = decode_budget(config.scheduler.max_num_batched_tokens, BATCHES, context, steps)
        engine = engine_for(config, kv, max(BATCHES), context + budget + 16)
        prefill_rate(engine, 16)  # warm-up: kernels built, allocator primed
        row = {"batched_16x512_64": batched(engine, 16, 512, 64),
               "decode_step_ms_ctx2048": decode_steps(engine, BATCHES, context, steps),
               "parallel8_tok_s": median_of(reps, lambda r: decode_rate(engine, 8, 16, 128)),
               "decode_d16_tok_s": median_of(reps, lambda r: decode_rate(engine, 1, 16, 128)),
               "decode_d2048_tok_s": median_of(reps,
                                               lambda r: decode_rate(engine, 1, 2048, 128)),
               "prefill_512_tok_s": median_of(reps, lambda r: prefill_rate(engine, 512, 7919 * r)),
               "prefill_2048_tok_s": median_of(reps,
                                               lambda r: prefill_rate(engine, 2048, 7919 * r)),
               "decode_path": dict(engine.stats().attention_paths),
               "weights": engine.runner.weights_class, "model_dtype": str(engine.runner.dtype)}
        if progress:
            print(f"slimkv {kv}: {row}", flush=True)
        out[kv] = row
        del engine
    return out


def ratios(slim: dict[str, Any], vllm: dict[str, Any], llama: dict[str, Any]
           ) -> dict[str, float | None]:
    """The issue's ratios; None where a side is missing."""
    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    def get(d: dict[str, Any], *keys: str) -> Any:
        for key in keys:
            if not isinstance(d, dict) or key not in d:
                return None
            d = d[key]
        return d

    timing = get(llama, "timing", LLAMACPP_KV) or {}
    out = {
        "batched_bf16_kv_vs_vllm": div(get(slim, "bfloat16", "batched_16x512_64", "total_tok_s"),
                                       get(vllm, "auto", "total_tok_s")),
        "batched_8bit_kv_vs_vllm": div(get(slim, "int8", "batched_16x512_64", "total_tok_s"),
                                       get(vllm, "fp8", "total_tok_s")),
        "parallel8_vs_llamacpp": div(get(slim, "int8", "parallel8_tok_s"),
                                     get(llama, "parallel_decode_128", LLAMACPP_KV, "x8",
                                         "tok_per_s_median")),
    }
    for batch in ("b16", "b32"):
        step = {kv: get(slim, kv, "decode_step_ms_ctx2048", batch)
                for kv in ("bfloat16", "int8", "int4")}
        out[f"step_int8_over_bf16_{batch}"] = div(step["int8"], step["bfloat16"])
        out[f"step_int4_over_int8_{batch}"] = div(step["int4"], step["int8"])
    for depth in ("d16", "d2048"):
        out[f"single_decode_{depth}_vs_llamacpp"] = div(
            get(slim, "int8", f"decode_{depth}_tok_s"),
            get(timing, f"decode_128_{depth}", "tok_per_s_median"))
    for n in (512, 2048):
        out[f"prefill_{n}_vs_llamacpp"] = div(get(slim, "int8", f"prefill_{n}_tok_s"),
                                              get(timing, f"prefill_{n}", "tok_per_s_median"))
    return out


def verdicts(values: dict[str, float | None]) -> dict[str, str]:
    """'met' / 'missed' / 'not measured' per ratio against :data:`TARGETS`."""
    out = {}
    for name, (target, higher) in TARGETS.items():
        value = values.get(name)
        met = value is not None and (value >= target if higher else value <= target)
        out[name] = "not measured" if value is None else "met" if met else "missed"
    return out


def bench_compare(config: Config, kv_dtypes: list[str], peers: Peers | None, reps: int,
                  context: int = 2048, steps: int = 16) -> dict[str, Any]:
    slim = bench_slimkv(config, kv_dtypes, context, steps, reps=reps)
    vllm: dict[str, Any] = {}
    llama: dict[str, Any] = {}
    if peers is not None:
        for kv in ("auto", "fp8"):
            vllm[kv] = peers.vllm(kv, 16, 512, 64)
            print(f"vllm-cpu {kv}: {vllm[kv].get('skipped') or vllm[kv].get('total_tok_s')}",
                  flush=True)
        llama = peers.llamacpp(reps)
        print(f"llama.cpp: {llama.get('skipped') or 'done'}", flush=True)
    values = ratios(slim, vllm, llama)
    return {"machine": machine_info(), "model_dtype": config.model.dtype,
            "workloads": {"batched": "16 prompts x 512 random tokens + 64 new, greedy",
                          "decode_step": f"mean ms/step, {steps} steps, contexts {context}",
                          "parallel8": "8 seqs, 16-token prompts, 128 new tokens each",
                          "single": "1 seq, 128 new tokens after 16 / 2048 prompt tokens"},
            "slimkv": slim, "vllm_cpu": vllm, "llamacpp": llama, "ratios": values,
            "targets": {k: {"target": t, "higher_is_better": h} for k, (t, h) in TARGETS.items()},
            "verdicts": verdicts(values)}


def format_ratios(result: dict[str, Any]) -> str:
    lines = [f"{'ratio':34} {'value':>8} {'target':>8}  verdict"]
    for name, (target, higher) in TARGETS.items():
        value = result["ratios"].get(name)
        shown = "-" if value is None else f"{value:.3f}"
        lines.append(f"{name:34} {shown:>8} {('>=' if higher else '<=')}{target:>6}  "
                     f"{result['verdicts'][name]}")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: str) -> None:
    """One bar per ratio, its target marked; green where met."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in TARGETS if result["ratios"].get(n) is not None]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.5))
    for y, name in enumerate(names):
        met = result["verdicts"][name] == "met"
        ax.barh(y, result["ratios"][name], color="tab:green" if met else "tab:red")
        ax.plot([TARGETS[name][0]] * 2, [y - 0.4, y + 0.4], color="black", lw=2)
    ax.set_yticks(range(len(names)), names)
    ax.invert_yaxis()
    ax.set_xlabel("ratio (black line: target; step ratios: lower is better)")
    machine = result["machine"]
    ax.set_title(f"slimkv vs peers, {machine['cpu']}, {machine['date'][:10]}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
