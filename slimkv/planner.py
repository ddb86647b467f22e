"""Capacity planning: how many sessions of a given context fit in a card, per KV dtype.

Every number comes from the engine's own code, so a plan is what the engine would do:
weights are the bytes of the engine's ``Transformer`` built under ``FakeTensorMode``
(nothing allocated), the activation reserve is :func:`slimkv.engine.memory.activation_peak` of
the largest step, and the KV pool is ``PagedKVCache.num_blocks_for_budget`` of what is
left: the arithmetic ``LLMEngine`` uses to size its pool.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from slimkv.config import DEFAULT_K_SCALE, INT4_GROUP, ConfigError
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import SINK_SHARE, Staging
from slimkv.engine.memory import activation_peak, weight_bytes
from slimkv.model.llama import ModelArgs, Transformer
from slimkv.stats import cdiv

MODELS_DIR = Path(__file__).parent / "data" / "models"
PLAN_KV_DTYPES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
WEIGHT_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16",
                 "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
                 "int8": "int8", "int4": "int4"}
# Quantized weight classes (slimkv.model.quant): codes plus float16 scale and min per 32.
_WEIGHT_BITS = {"int8": 8, "int4": 4}
# Architectures whose tensor shapes are the Llama decoder's (planning needs shapes only).
_SAME_SHAPES = {"mistral": "llama"}
_UNITS = {"": 2**30, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def builtin_models() -> list[str]:
    return sorted(p.stem for p in MODELS_DIR.glob("*.json"))


def parse_bytes(text: str) -> int:
    """``80GiB``, ``80GB``, ``512MiB``; a bare number means GiB (like ``kv_cache.memory_gb``)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read memory size {text!r}; write e.g. 80GiB, 80GB or 512MiB")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def load_hf_config(model: str) -> tuple[str, dict[str, Any]]:
    """(name, config dict) of a built-in name, a ``config.json`` path or a model directory."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        path = MODELS_DIR / f"{model.lower()}.json"
    if not path.is_file():
        raise ValueError(f"no config.json at {model!r} and no built-in model of that name; "
                         f"built-in: {', '.join(builtin_models())}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a config.json must be a JSON object")
    return (path.stem if path.parent == MODELS_DIR else str(path)), cfg


def planning_args(cfg: dict[str, Any]) -> ModelArgs:
    """The engine's ``ModelArgs`` for a config, ignoring what does not change tensor sizes
    (RoPE scaling, Mistral's model_type). Sliding windows are planned as full attention:
    the paged cache keeps every token."""
    shapes = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "use_sliding_window")}
    shapes["rope_parameters"] = None
    shapes["model_type"] = _SAME_SHAPES.get(cfg.get("model_type"), cfg.get("model_type"))
    try:
        return ModelArgs.from_hf_config(shapes)
    except KeyError as exc:
        raise ConfigError(f"model config: missing key {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model config: {exc}") from exc


def model_weight_bytes(args: ModelArgs, dtype: torch.dtype, bits: int | None = None) -> int:
    """Bytes of the engine's ``Transformer`` for ``args`` (parameters and RoPE tables);
    with ``bits``, its matrices (projections, embedding, LM head) in that quantized class."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = Transformer(args, dtype, torch.device("cpu"))
        if bits is None:
            return weight_bytes(model)
        tensors = [*model.named_parameters(), *model.named_buffers()]
        # RoPE tables are float32 in a quantized model (slimkv.model.lean).
        return int(sum(t.numel() * (bits / 8 + 4 / 32) if t.dim() == 2 and name.endswith(".weight")
                       else t.numel() * (4 if name.startswith("rope_") else t.element_size())
                       for name, t in tensors))


def bits_per_element(context: int, sink_bytes: int = 0, **shape: Any) -> float:
    """Stored bits per K/V element of one sequence of ``context`` tokens in the layout
    ``shape`` (:meth:`PagedKVCache.block_bytes`'s arguments, ``int4_group_size`` included):
    its whole blocks, i.e. the data, the per-token scales and zeros and the per-block ones
    amortised over the block's tokens, and the last block's unused tail; K and V averaged.
    E.g. int4 at head_dim 64, blocks of 16 and a context of whole blocks: per-token groups
    of 32 5.0, of 64 4.5; per-channel-block keys 6.0 (4 + a float16 scale and zero per
    channel over 16 tokens), so with group-32 values 5.5. ``sink_bytes``: the sequence's
    float sink block, held on top of its pool blocks (the int4 sink)."""
    blocks = cdiv(context, shape["block_size"])
    elements = 2 * shape["num_layers"] * shape["num_kv_heads"] * shape["head_dim"] * context
    return 8 * (blocks * PagedKVCache.block_bytes(**shape) + sink_bytes) / elements


@dataclass(slots=True)
class KVRow:
    kv_dtype: str
    bytes_per_token: int
    bits_per_element: float        # at ``context``: see :func:`bits_per_element`
    num_blocks: int
    max_sessions: int              # sessions of ``context`` tokens that fit
    context_at_sessions: int       # tokens each of ``sessions`` sessions can hold


@dataclass(slots=True)
class Plan:
    model: str
    memory: int
    weight_dtype: str
    weights: int
    activation_reserve: int
    kv_budget: int
    block_size: int
    context: int
    sessions: int
    max_position_embeddings: int
    rows: list[KVRow]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(model: str, memory: int, *, context: int = 32768, sessions: int = 48,
         weight_dtype: str = "bf16", block_size: int = 16, batch_tokens: int = 512,
         kv_dtypes: tuple[str, ...] = PLAN_KV_DTYPES,
         k_scale: str = DEFAULT_K_SCALE, int4_group_size: int = INT4_GROUP) -> Plan:
    """Plan ``model`` on a device with ``memory`` bytes for the engine (see module doc);
    ``k_scale`` and ``int4_group_size`` (``kv_cache.int4.group_size``) choose the layout
    whose real bytes each row counts."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; choose one of {', '.join(WEIGHT_DTYPES)}")
    if context <= 0 or sessions <= 0:
        raise ValueError("--context and --sessions must be positive")
    name, cfg = load_hf_config(model)
    args = planning_args(cfg)
    bits = _WEIGHT_BITS.get(WEIGHT_DTYPES[weight_dtype])
    dtype = torch.bfloat16 if bits else getattr(torch, WEIGHT_DTYPES[weight_dtype])
    weights = model_weight_bytes(args, dtype, bits)
    reserve = max(activation_peak(args, dtype, torch.device("cpu"), k_dtype=kv, v_dtype=kv,
                                  k_scale=k_scale, block_size=block_size, num_tokens=batch_tokens,
                                  num_logit_rows=sessions) for kv in kv_dtypes)
    budget = memory - weights - reserve
    if budget < 0:
        raise ValueError(f"{name} does not fit in {memory / 2**30:.1f} GiB: its {weight_dtype} "
                         f"weights take {weights / 2**30:.2f} GiB and the activation reserve "
                         f"{reserve / 2**30:.2f} GiB, leaving nothing for the KV cache")
    rows = [_row(args, kv, budget, block_size, context, sessions, k_scale, dtype,
                 int4_group_size) for kv in kv_dtypes]
    return Plan(name, memory, WEIGHT_DTYPES[weight_dtype], weights, reserve, budget, block_size,
                context, sessions, args.max_position_embeddings, rows)


def _row(args: ModelArgs, kv: str, budget: int, block_size: int, context: int,
         sessions: int, k_scale: str, dtype: torch.dtype,
         int4_group_size: int = INT4_GROUP) -> KVRow:
    """One dtype's capacity; a staged layout sets aside a staging block per session (+1
    for scoring), as the engine does, and int4 its sink blocks (:func:`sink_blocks`)."""
    shape = dict(num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
                 head_dim=args.head_dim, k_dtype=kv, v_dtype=kv, k_scale=k_scale,
                 int4_group_size=int4_group_size)
    staged = Staging.needed(kv, kv, args.head_dim, k_scale)
    sinks = sink_blocks(kv, sessions + 1) if staged else 0
    if sinks:  # capped to a share of the budget, as the engine caps them
        one = (Staging.bytes(args.num_layers, args.num_kv_heads, args.head_dim, block_size, 1,
                             dtype) + PagedKVCache.block_bytes(**shape, block_size=block_size))
        sinks = min(sinks, budget // SINK_SHARE // one)
    staging = Staging.bytes(args.num_layers, args.num_kv_heads, args.head_dim, block_size,
                            sessions + 1 + sinks, dtype) if staged else 0
    blocks = PagedKVCache.num_blocks_for_budget(budget, staging, **shape,
                                                block_size=block_size) - sinks
    return KVRow(kv, PagedKVCache.bytes_per_token(**shape, block_size=block_size),
                 bits_per_element(context, sinks and Staging.bytes(
                     args.num_layers, args.num_kv_heads, args.head_dim, block_size, 1, dtype),
                     **shape, block_size=block_size), blocks,
                 max_sessions=blocks // cdiv(context, block_size),
                 context_at_sessions=blocks // sessions * block_size)


def sink_blocks(kv: str, num_staging_slots: int, sink_block: bool = True) -> int:
    """Blocks of the float sink region (``kv_cache.int4.sink_block``, docs/kv-formats.md):
    two per staging slot, as the engine sizes it (slimkv/engine/runner.py: at most
    1/``SINK_SHARE`` of the budget, which :func:`_row` applies), each taking a float block in
    the staging buffer and a pool block's bytes."""
    return 2 * num_staging_slots if kv == "int4" and sink_block else 0


def format_plan(p: Plan, selected: str | None = None) -> str:
    gib = 2**30
    lines = [f"model {p.model}: {p.weight_dtype} weights {p.weights / gib:.2f} GiB, activation "
             f"reserve {p.activation_reserve / 2**20:.0f} MiB, KV budget {p.kv_budget / gib:.2f} "
             f"GiB of {p.memory / gib:.2f} GiB (block {p.block_size} tokens)",
             f"{'kv dtype':<10} {'KiB/token':>10} {'bits/elem':>9} {'blocks':>9} "
             f"{f'sessions@{p.context}':>16} "
             f"{f'context@{p.sessions} sessions':>22}"]
    for r in p.rows:
        mark = " *" if selected and r.kv_dtype.startswith(selected) else ""
        lines.append(f"{r.kv_dtype:<10} {r.bytes_per_token / 1024:>10.2f} "
                     f"{r.bits_per_element:>9.2f} {r.num_blocks:>9} "
                     f"{r.max_sessions:>16} {r.context_at_sessions:>22}{mark}")
    if any(r.context_at_sessions > p.max_position_embeddings for r in p.rows):
        lines.append(f"(the model's own limit is {p.max_position_embeddings} tokens per session)")
    return "\n".join(lines)
