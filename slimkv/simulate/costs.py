"""How long a step takes on a device: a roofline from bytes and FLOPs.

Per step the model reads its weights once (``weight_bytes``), reads every scheduled
sequence's KV context and writes its new tokens at the KV dtype's bytes per token
*including scales* (``PagedKVCache.bytes_per_token``, the engine's own arithmetic), and
does ``2 * linear_params`` FLOPs per token, plus ``4 * layers * heads * head_dim`` per
(query, key) pair of attention and ``2 * hidden * vocab`` per sampled row. Then

    t = overhead + per_seq * sequences + combine(bytes / (BW * bw_eff), flops / (F * flop_eff))

``combine`` is ``max`` on an accelerator (memory and tensor cores overlap: the roofline)
and ``sum`` on this CPU (eager torch runs one op after another). GPU efficiencies are
stated assumptions (``GPU_DEFAULTS``); on the CPU the constants are fitted to measured
steps (:mod:`slimkv.simulate.calibrate`), with attention as its own term (seconds per
query-key pair: the CPU's paged-decode kernel converts every cached element it reads, far
below GEMM speed), and the fit is tested on a held-out level.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from slimkv.kv.cache import PagedKVCache
from slimkv.model.llama import ModelArgs
from slimkv.simulate.engine import Batch

DEVICES_PATH = Path(__file__).resolve().parent.parent / "data" / "devices.json"
# Stated, not fitted: what a tuned serving stack reaches on a data-centre GPU (vLLM-class
# paged attention kernels reach ~80% of HBM bandwidth; prefill GEMMs ~60% of peak).
GPU_DEFAULTS = dict(bw_eff=0.8, flop_eff=0.6, overhead_s=0.004, per_seq_s=2e-5)


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    hbm_gbps: float
    bf16_tflops: float
    memory_gb: float
    bw_eff: float = GPU_DEFAULTS["bw_eff"]
    flop_eff: float = GPU_DEFAULTS["flop_eff"]
    overhead_s: float = GPU_DEFAULTS["overhead_s"]
    per_seq_s: float = GPU_DEFAULTS["per_seq_s"]
    overlap: bool = True        # max(memory, compute); False: their sum
    attn_s_per_pair: float | None = None   # fitted CPU decode kernel; None: FLOPs at F

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gb * 1e9)


def devices() -> dict[str, Device]:
    data = json.loads(DEVICES_PATH.read_text())
    return {name: Device(name, d["hbm_gbps"], d["bf16_tflops"], d["memory_gb"])
            for name, d in data.items() if not name.startswith("_")}


def device(name: str) -> Device:
    table = devices()
    if name not in table:
        raise ValueError(f"unknown device {name!r}; choose one of {', '.join(table)}")
    return table[name]


@dataclass(frozen=True, slots=True)
class ModelCost:
    """What a step costs per token and per step for one model and KV layout."""

    weight_bytes: int
    linear_params: int          # parameters every token multiplies (not the embedding)
    attn_flops_per_pair: int    # one query against one key, all layers
    logit_flops: int            # one sampled row
    kv_bytes_per_token: float

    @classmethod
    def of(cls, args: ModelArgs, weight_bytes: int, k_dtype: str, v_dtype: str,
           k_scale: str, block_size: int = 16) -> ModelCost:
        d, hd = args.hidden_size, args.head_dim
        per_layer = (d * args.num_heads * hd * 2 + d * args.num_kv_heads * hd * 2
                     + 3 * d * args.intermediate_size)
        return cls(weight_bytes, args.num_layers * per_layer,
                   4 * args.num_layers * args.num_heads * hd, 2 * d * args.vocab_size,
                   PagedKVCache.bytes_per_token(
                       num_layers=args.num_layers, num_kv_heads=args.num_kv_heads,
                       head_dim=hd, k_dtype=k_dtype, v_dtype=v_dtype, k_scale=k_scale,
                       block_size=block_size))

    def step_bytes(self, batch: Batch) -> float:
        kv_tokens = sum(c + n for c, n in zip(batch.context, batch.new_tokens))
        return self.weight_bytes + kv_tokens * self.kv_bytes_per_token

    @staticmethod
    def step_pairs(batch: Batch) -> float:
        """(query, key) pairs of attention, causal within a chunk."""
        return sum(n * (c + (n + 1) / 2) for c, n in zip(batch.context, batch.new_tokens))

    def linear_flops(self, batch: Batch) -> float:
        return 2 * self.linear_params * batch.num_tokens + self.logit_flops * batch.num_sampled

    def step_flops(self, batch: Batch) -> float:
        return self.linear_flops(batch) + self.attn_flops_per_pair * self.step_pairs(batch)


@dataclass(frozen=True, slots=True)
class StepModel:
    """A device running a model: ``model(batch)`` is the step's seconds."""

    device: Device
    cost: ModelCost

    def __call__(self, batch: Batch) -> float:
        dev = self.device
        mem = self.cost.step_bytes(batch) / (dev.hbm_gbps * 1e9 * dev.bw_eff)
        if dev.attn_s_per_pair is None:
            comp = self.cost.step_flops(batch) / (dev.bf16_tflops * 1e12 * dev.flop_eff)
        else:
            comp = (self.cost.linear_flops(batch) / (dev.bf16_tflops * 1e12 * dev.flop_eff)
                    + dev.attn_s_per_pair * self.cost.step_pairs(batch))
        busy = max(mem, comp) if dev.overlap else mem + comp
        return dev.overhead_s + dev.per_seq_s * len(batch.new_tokens) + busy
