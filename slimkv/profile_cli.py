"""``slimkv profile``, ``slimkv plan`` and ``slimkv verify``: profile first, then choose the fix."""

from __future__ import annotations

import argparse
import resource
from typing import TYPE_CHECKING, Any

import torch

from slimkv.cli import add_config_args, config_from_args, print_json
from slimkv.config import DEFAULT_K_SCALE, INT4_GROUP, INT4_GROUP_SIZES, K_SCALES
from slimkv.kv.cache import PagedKVCache
from slimkv.engine.memory import LiveBytes
from slimkv.engine.sampling import SamplingParams
from slimkv.workload import random_prompt

if TYPE_CHECKING:
    from slimkv.engine.llm_engine import LLMEngine

MiB = 2**20


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("profile", help="measured memory split of a real workload")
    add_config_args(p)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--context", type=int, default=256, help="tokens per session")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_profile)

    p = sub.add_parser("plan", help="sessions that fit per KV dtype for a model config")
    p.add_argument("--model", required=True, help="config.json, model directory or built-in name")
    p.add_argument("--memory", required=True,
                   help="device memory for the engine, e.g. 80GiB; 'device': this CUDA device's "
                        "share kv_cache.memory_fraction of its memory, less what is in use")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--sessions", type=int, default=48, help="for 'context that fits at C sessions'")
    p.add_argument("--weight-dtype", default="bf16")
    p.add_argument("--kv-dtype", default="int8", help="row to highlight")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--k-scale", default=DEFAULT_K_SCALE, choices=K_SCALES,
                   help="kv_cache.k_scale: the key layout the rows count")
    p.add_argument("--int4-group-size", type=int, default=INT4_GROUP, choices=INT4_GROUP_SIZES,
                   help="kv_cache.int4.group_size: per-token int4 channels per scale")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("verify", help="prove the quantized attention path runs, per layer")
    add_config_args(p)
    p.add_argument("--all", action="store_true", help="every KV dtype, not just the configured")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)


def cmd_profile(args: argparse.Namespace) -> int:
    from slimkv.plugins import build_engine

    if args.sessions <= 0 or args.context <= 0:
        raise ValueError("--sessions and --context must be positive")
    engine = build_engine(config_from_args(args))
    measured = run_workload(engine, args.sessions, args.context)
    share, advice = recommend(engine, measured, args.sessions, args.context)
    report = {"model": engine.model_name, "device": str(engine.runner.device),
              "weights_class": engine.runner.weights_class,
              "kv_dtype": {"k": engine.runner.k_dtype, "v": engine.runner.v_dtype}, "sessions": args.sessions,
              "context": args.context, "bytes": measured, "kv_share": share, "recommendation": advice}
    if args.json:
        print_json(report)
        return 0
    m = measured
    print(f"{engine.model_name} on {engine.runner.device}, weights {engine.runner.weights_class}, "
          f"KV {engine.runner.k_dtype}/{engine.runner.v_dtype} "
          f"(K scales {engine.config.kv_cache.k_scale}), "
          f"{args.sessions} sessions x {args.context} tokens")
    for key in ("weights", "kv_allocated", "kv_in_use", "kv_staging", "activations",
                "activations_startup", "other"):
        print(f"  {key:<20} {m[key] / MiB:>10.1f} MiB")
    if "device_total" in m:
        print(f"  device: {m['device_free'] / MiB:.0f} MiB free of {m['device_total'] / MiB:.0f}")
    print(f"  KV blocks: {m['kv_blocks_in_use']} in use of {m['kv_blocks']} x "
          f"{m['kv_bytes_per_block']} B\n  measured by: {m['method']}\n{advice}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from slimkv.planner import format_plan, parse_bytes, plan

    memory = device_memory() if args.memory == "device" else parse_bytes(args.memory)
    result = plan(args.model, memory, context=args.context,
                  sessions=args.sessions, weight_dtype=args.weight_dtype,
                  block_size=args.block_size, batch_tokens=args.batch_tokens,
                  k_scale=args.k_scale, int4_group_size=args.int4_group_size)
    if args.json:
        print_json(result.to_dict())
    else:
        print(format_plan(result, args.kv_dtype))
    return 0


def device_memory() -> int:
    """What an engine on the CUDA device may use before its weights: ``kv_budget`` with the
    default ``memory_fraction`` and no activations (the plan reserves those itself)."""
    from slimkv.config import KVCacheConfig
    from slimkv.engine.memory import kv_budget

    if not torch.cuda.is_available():
        raise ValueError("--memory device reads a CUDA device's memory; none is available "
                         "here: give a size such as 80GiB")
    return kv_budget(*torch.cuda.mem_get_info(), KVCacheConfig().memory_fraction, 0)


def cmd_verify(args: argparse.Namespace) -> int:
    from slimkv.verify import ALL_KV_DTYPES, format_report, verify

    config = config_from_args(args)
    kv = config.kv_cache
    configured = (kv.k_dtype or kv.dtype, kv.v_dtype or kv.dtype)
    dtypes = list(ALL_KV_DTYPES) if args.all else list(dict.fromkeys(configured))
    results = verify(config, dtypes)
    print_json(results) if args.json else print(format_report(results))
    return 0 if all(r["ok"] for r in results) else 1


def run_workload(engine: LLMEngine, sessions: int, context: int, new_tokens: int = 4) -> dict[str, Any]:
    """Serve ``sessions`` random prompts of ``context`` tokens (``new_tokens`` generated each)
    and return the measured memory split in bytes, with how each figure was measured."""
    runner = engine.runner
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    prompt_len = max(1, context - new_tokens)
    for i in range(sessions):
        engine.add_request(random_prompt(prompt_len, engine.model_args.vocab_size, seed=i), params)
    peak_blocks = 0
    cuda = runner.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(runner.device)
        torch.cuda.reset_peak_memory_stats(runner.device)
        before = torch.cuda.memory_allocated(runner.device)
    with LiveBytes() as tracker:
        while engine.has_unfinished():
            engine.step()
            peak_blocks = max(peak_blocks, sum(len(s.blocks) for s in engine.requests.values()))
    split = engine.memory_split()
    if cuda:
        activations = torch.cuda.max_memory_allocated(runner.device) - before
        other = torch.cuda.max_memory_reserved(runner.device) - torch.cuda.max_memory_allocated(runner.device)
        free, total = torch.cuda.mem_get_info(runner.device)
        method = ("CUDA: caching allocator statistics (activations = max_memory_allocated "
                  "during the steps above what was allocated before; other = "
                  "max_memory_reserved - max_memory_allocated); device = mem_get_info")
    else:
        activations = tracker.peak
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        other = max(0, peak_rss - split["weights"] - split["kv_cache"] - split["kv_staging"]
                    - activations)
        method = ("CPU: weights and KV pool = bytes of the engine's own tensors; activations = "
                  "peak live bytes of tensors created during the steps (TorchDispatchMode); "
                  "other = peak RSS minus those (Python, torch runtime; untouched pool pages "
                  "are not resident, so it can read 0)")
    return {"weights": split["weights"], "kv_allocated": split["kv_cache"],
            "kv_staging": split["kv_staging"],
            "kv_in_use": peak_blocks * runner.cache.bytes_per_block, "kv_blocks": engine.pool.num_blocks,
            "kv_blocks_in_use": peak_blocks, "kv_bytes_per_block": runner.cache.bytes_per_block,
            "activations": activations, "activations_startup": split["activations"],
            "other": other, "method": method,
            **({"device_free": free, "device_total": total} if cuda else {})}


def recommend(engine: LLMEngine, m: dict[str, Any], sessions: int, context: int) -> tuple[float, str]:
    """KV share of memory in use and what to do about it, in words."""
    runner = engine.runner
    total = m["weights"] + m["kv_in_use"] + m["activations"] + m["other"]
    share = m["kv_in_use"] / total
    args = engine.model_args
    int8_per_token = PagedKVCache.bytes_per_token(
        num_layers=args.num_layers, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim,
        k_dtype="int8", v_dtype="int8", k_scale=engine.config.kv_cache.k_scale,
        block_size=runner.cache.block_size)
    kv_saving = m["kv_in_use"] * max(0.0, 1 - int8_per_token / runner.bytes_per_token) / total
    weight_saving = m["weights"] * (1 - 1 / runner.dtype.itemsize) / total
    head = f"KV cache is {share:.0%} of memory in use at {sessions} sessions x {context} tokens"
    if kv_saving > weight_saving:
        return share, (f"{head}: quantize the KV cache to int8 first (saves {kv_saving:.0%}); "
                       f"int8 weights would save at most {weight_saving:.0%}")
    if kv_saving > 0:
        return share, (f"{head}: weights dominate; int8 weights would save up to "
                       f"{weight_saving:.0%}, int8 KV {kv_saving:.0%}")
    return share, (f"{head}; the KV cache is already {runner.k_dtype}/{runner.v_dtype}; "
                   f"int8 weights would save at most {weight_saving:.0%}")
