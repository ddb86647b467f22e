"""One card serving one model with one KV layout: its pool from ``slimkv plan``'s memory
split (weights, activation reserve, KV budget, staging), its step-time model, and a fresh
:class:`SimEngine` per run."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch

from slimkv.config import DEFAULT_K_SCALE, KVCacheConfig, SchedulerConfig
from slimkv.kv.staging import Staging
from slimkv.planner import load_hf_config, model_weight_bytes, plan, planning_args
from slimkv.simulate.costs import Device, ModelCost, StepModel
from slimkv.simulate.engine import SimEngine


@dataclass(frozen=True, slots=True)
class Variant:
    dtype: str            # the planner's names: bfloat16, int8, fp8_e4m3, int4
    paged: bool = True
    k_scale: str = DEFAULT_K_SCALE

    @property
    def name(self) -> str:
        short = {"bfloat16": "bf16", "fp8_e4m3": "fp8"}.get(self.dtype, self.dtype)
        tail = "" if self.k_scale == DEFAULT_K_SCALE or self.dtype == "bfloat16" else \
            f" ({self.k_scale} K)"
        return f"{short} {'paged' if self.paged else 'contiguous'}{tail}"


VARIANTS = (Variant("bfloat16", False), Variant("bfloat16"), Variant("int8"),
            Variant("fp8_e4m3"), Variant("int4"))


@functools.lru_cache(maxsize=16)
def _weights(model: str) -> tuple:
    _, cfg = load_hf_config(model)
    args = planning_args(cfg)
    return args, model_weight_bytes(args, torch.bfloat16)


@dataclass(frozen=True, slots=True)
class Card:
    model: str
    device: Device
    variant: Variant
    context: int
    kv: KVCacheConfig
    sched: SchedulerConfig
    num_blocks: int
    num_staging_slots: int
    kv_budget: int
    weight_bytes: int
    step_model: StepModel

    @classmethod
    def build(cls, model: str, device: Device, variant: Variant, context: int, *,
              soft: int = 48, watermark: float = 0.7, sched: SchedulerConfig | None = None,
              **kv_changes) -> Card:
        """The card as ``slimkv plan`` splits its memory (sized for ``soft`` sessions)."""
        sched = sched or SchedulerConfig()
        args, weights = _weights(model)
        p = plan(model, device.memory_bytes, context=context, sessions=soft,
                 block_size=16, batch_tokens=sched.max_num_batched_tokens,
                 kv_dtypes=(variant.dtype,), k_scale=variant.k_scale)
        staged = Staging.needed(variant.dtype, variant.dtype, args.head_dim, variant.k_scale)
        kv = KVCacheConfig(dtype=variant.dtype, k_scale=variant.k_scale, paged=variant.paged,
                           num_blocks=p.rows[0].num_blocks, max_concurrency_soft=soft,
                           watermark=watermark, **kv_changes)
        cost = ModelCost.of(args, weights, variant.dtype, variant.dtype, variant.k_scale)
        return cls(model, device, variant, context, kv, sched, p.rows[0].num_blocks,
                   soft + 1 if staged else 0, p.kv_budget, weights, StepModel(device, cost))

    def with_kv(self, **changes) -> Card:
        return dataclasses.replace(self, kv=dataclasses.replace(self.kv, **changes))

    def with_sched(self, **changes) -> Card:
        return dataclasses.replace(self, sched=dataclasses.replace(self.sched, **changes))

    def engine(self, start: float = 0.0) -> SimEngine:
        return SimEngine(self.kv, self.sched, self.num_blocks, self.context, self.step_model,
                         self.num_staging_slots, start)

    def facts(self) -> dict:
        return {"model": self.model, "device": self.device.name, "variant": self.variant.name,
                "kv_budget_gb": round(self.kv_budget / 1e9, 2),
                "weights_gb": round(self.weight_bytes / 1e9, 2), "num_blocks": self.num_blocks,
                "kv_kib_per_token": round(self.step_model.cost.kv_bytes_per_token / 1024, 2),
                "staging_slots": self.num_staging_slots,
                "max_concurrency_soft": self.kv.max_concurrency_soft,
                "watermark": self.kv.watermark}
