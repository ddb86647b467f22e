"""``slimkv`` command line. Each command lives beside the code it drives and registers
itself here through an ``add_cli(subparsers)`` function."""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from pathlib import Path
from typing import Any

from slimkv.config import KV_DTYPES, Config, ConfigError

COMMAND_MODULES = ("slimkv.cli", "slimkv.bench.cli", "slimkv.server.cli",
                   "slimkv.profile_cli", "slimkv.eval.cli", "slimkv.loadtest.cli")


def add_config_args(parser: argparse.ArgumentParser) -> None:
    """Options every engine command shares: a config file and common overrides."""
    parser.add_argument("--config", help="YAML config (default: the embedded default)")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, help="override kv_cache.dtype")
    parser.add_argument("--model", dest="model_path", help="override model.path (GGUF or HF dir)")
    parser.add_argument("--device", help="override model.device (auto, cpu, cuda, cuda:N)")


def config_from_args(args: argparse.Namespace) -> Config:
    config = Config.load(args.config)
    if getattr(args, "kv_dtype", None):
        config = config.replace("kv_cache", dtype=args.kv_dtype, k_dtype=None, v_dtype=None,
                                layer_dtypes=None)
    if getattr(args, "model_path", None):
        config = config.replace("model", path=args.model_path)
    if getattr(args, "device", None):
        config = config.replace("model", device=args.device)
    return config


def csv_of(kind: type):
    """An argparse type: a comma-separated list of ``kind``."""
    return lambda text: [kind(x) for x in text.split(",") if x]


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def write_result(result: dict, args: argparse.Namespace) -> int:
    """Write a benchmark's JSON to ``args.out`` (and print it with ``args.json``)."""
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")
    if args.json:
        print(json.dumps(result, indent=2))
    return 0


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("prompt")
    add_config_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    from slimkv.llm import LLM
    from slimkv.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
    llm = LLM(config_from_args(args))
    if args.chat:
        [result] = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        [result] = llm.generate(args.prompt, params)
    if args.json:
        stats = llm.engine.stats()
        print_json({"text": result.text, "finish_reason": result.finish_reason,
                    "prompt_tokens": len(result.prompt_token_ids),
                    "completion_tokens": len(result.token_ids), "model": stats.model_name,
                    "kv_dtype": {"k": stats.k_dtype, "v": stats.v_dtype}})
    else:
        print(result.text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slimkv", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError) as exc:
        print(f"slimkv: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
