"""``slimkv profile``, ``slimkv plan`` and ``slimkv verify``: profile first, then choose the fix."""

from __future__ import annotations

import argparse

from slimkv.cli import add_config_args, config_from_args, print_json

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
    p.add_argument("--memory", required=True, help="device memory for the engine, e.g. 80GiB")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--sessions", type=int, default=48, help="for 'context that fits at C sessions'")
    p.add_argument("--weight-dtype", default="bf16")
    p.add_argument("--kv-dtype", default="int8", help="row to highlight")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=512, help="max_num_batched_tokens")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("verify", help="prove the quantized attention path runs, per layer")
    add_config_args(p)
    p.add_argument("--all", action="store_true", help="every KV dtype, not just the configured")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_verify)


def cmd_profile(args: argparse.Namespace) -> int:
    from slimkv.engine import LLMEngine
    from slimkv.profiler import recommend, run_workload

    if args.sessions <= 0 or args.context <= 0:
        raise ValueError("--sessions and --context must be positive")
    engine = LLMEngine(config_from_args(args))
    measured = run_workload(engine, args.sessions, args.context)
    share, advice = recommend(engine, measured, args.sessions, args.context)
    report = {"model": engine.model_name, "device": str(engine.device),
              "kv_dtype": {"k": engine.k_dtype, "v": engine.v_dtype}, "sessions": args.sessions,
              "context": args.context, "bytes": measured, "kv_share": share, "recommendation": advice}
    if args.json:
        print_json(report)
        return 0
    m = measured
    print(f"{engine.model_name} on {engine.device}, KV {engine.k_dtype}/{engine.v_dtype} "
          f"(K scales {engine.config.kv_cache.k_scale}), "
          f"{args.sessions} sessions x {args.context} tokens")
    for key in ("weights", "kv_allocated", "kv_in_use", "kv_staging", "activations",
                "activations_startup", "other"):
        print(f"  {key:<20} {m[key] / MiB:>10.1f} MiB")
    print(f"  KV blocks: {m['kv_blocks_in_use']} in use of {m['kv_blocks']} x "
          f"{m['kv_bytes_per_block']} B\n  measured by: {m['method']}\n{advice}")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from slimkv.planner import format_plan, parse_bytes, plan

    result = plan(args.model, parse_bytes(args.memory), context=args.context,
                  sessions=args.sessions, weight_dtype=args.weight_dtype,
                  block_size=args.block_size, batch_tokens=args.batch_tokens)
    if args.json:
        print_json(result.to_dict())
    else:
        print(format_plan(result, args.kv_dtype))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from slimkv.verify import ALL_KV_DTYPES, format_report, verify

    config = config_from_args(args)
    kv = config.kv_cache
    dtypes = list(ALL_KV_DTYPES) if args.all else list(dict.fromkeys((kv.key_dtype, kv.value_dtype)))
    results = verify(config, dtypes)
    print_json(results) if args.json else print(format_report(results))
    return 0 if all(r["ok"] for r in results) else 1
