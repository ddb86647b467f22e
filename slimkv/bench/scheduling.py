"""``slimkv bench scheduling``: the scheduler's policies on the real engine.

Two experiments from the case, each run under both of its settings on the same workload:
- lanes: one long prompt arrives first, then short chat requests; short-request time to
  first token (seconds and engine steps) under ``fcfs`` and under ``weighted``;
- paging: requests of mixed lengths in the same KV memory, contiguous (reserve
  ``max_model_len`` per request) vs paged; peak concurrency and false-OOM count.
"""

from __future__ import annotations

from typing import Any

from slimkv.bench.engine import machine_info
from slimkv.config import Config
from slimkv.plugins import build_engine
from slimkv.engine.sampling import SamplingParams
from slimkv.workload import percentile, random_prompt


def run_lanes(config: Config, policy: str, long_tokens: int, num_short: int,
              short_tokens: int) -> dict[str, Any]:
    engine = build_engine(config.replace("scheduler", policy=policy))
    vocab = engine.model_args.vocab_size
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    if long_tokens:
        engine.add_request(random_prompt(long_tokens, vocab, seed=0), params)
    shorts = [engine.add_request(random_prompt(short_tokens, vocab, seed=1 + i), params)
              for i in range(num_short)]
    ttft_s: dict[str, float] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.ttft is not None:
                ttft_s[out.request_id] = out.ttft
    seconds = [ttft_s[s.request_id] for s in shorts]
    steps = [float(s.first_token_step - s.arrival_step) for s in shorts]
    return {"policy": policy, "long_prompt_tokens": long_tokens,
            "short_ttft_p50_s": round(percentile(seconds, 50), 3),
            "short_ttft_p99_s": round(percentile(seconds, 99), 3),
            "short_ttft_p50_steps": percentile(steps, 50),
            "short_ttft_p99_steps": percentile(steps, 99)}


def run_paging(config: Config, paged: bool, prompt_lens: list[int]) -> dict[str, Any]:
    engine = build_engine(config.replace("kv_cache", paged=paged, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for i, n in enumerate(prompt_lens):
        engine.add_request(random_prompt(n, engine.model_args.vocab_size, seed=i), params)
    peak_running = peak_used = steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        stats = engine.stats()
        peak_running = max(peak_running, stats.num_running)
        peak_used = max(peak_used, stats.num_blocks_used)
    return {"paged": paged, "requests": len(prompt_lens), "peak_running": peak_running,
            "peak_blocks_reserved": peak_used, "pool_blocks": stats.num_blocks,
            "false_oom": stats.false_ooms, "steps": steps}


def bench_scheduling(config: Config, long_tokens: int = 4096, num_short: int = 16,
                     short_tokens: int = 64) -> dict[str, Any]:
    lanes_cfg = config.replace("kv_cache", watermark=1.0,
                               memory_gb=None, num_blocks=1024)
    lanes = [run_lanes(lanes_cfg, "weighted", 0, num_short, short_tokens)]
    lanes += [run_lanes(lanes_cfg, p, long_tokens, num_short, short_tokens)
              for p in ("fcfs", "weighted")]
    for row in lanes:
        print("lanes", row, flush=True)
    paging_cfg = config.replace("kv_cache", memory_gb=None, num_blocks=128, watermark=1.0)
    paging_cfg = paging_cfg.replace("model", max_model_len=1024)
    lens = [40, 300, 60, 500, 80, 120, 30, 200, 90, 400, 50, 150]
    paging = [run_paging(paging_cfg, paged, lens) for paged in (False, True)]
    for row in paging:
        print("paging", row, flush=True)
    return {"machine": machine_info(), "kv_dtype": config.kv_cache.dtype,
            "lanes": lanes, "paging": paging}
