"""Measure where memory goes: weights, KV pool, activations (below the engine, which
measures its activation peak at start-up; ``slimkv profile`` measures a real workload).

Activations are measured by :class:`LiveBytes`, a ``TorchDispatchMode`` that sees every
tensor an ATen op returns, counts the bytes of each *new* storage while any tensor
viewing it is alive, and keeps the peak. Pre-existing storages (weights, the KV pool)
are never counted, so the peak is the step's activation/workspace high-water mark.
Kernel-internal scratch that never becomes a tensor is not visible to it.

The engine's start-up measurement (:func:`activation_peak`) replays the largest step the
scheduler can issue (``max_num_batched_tokens`` prompt tokens, logits for up to
``max_concurrency_soft`` rows) under ``FakeTensorMode``: shapes, dtypes and the device's
op choices are real, but nothing is computed or allocated, so it costs well under a
second even for a 7B model, and the planner uses the same function for any config.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections import Counter
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from slimkv.attention.layer import PagedAttention
from slimkv.attention.metadata import AttentionMetadata
from slimkv.config import ConfigError
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.layers import LayerDtypes, layer_dtype_names
from slimkv.kv.staging import Staging
from slimkv.model.llama import ModelArgs, Transformer
from slimkv.stats import cdiv


class LiveBytes(TorchDispatchMode):
    """Peak bytes of storages created by ops run under this mode (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: Counter[int] = Counter()     # storage key -> live tensors viewing it
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        inputs = {_key(t) for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._track(t, inputs)
        return out

    def _track(self, t: torch.Tensor, inputs: set[int]) -> None:
        key = _key(t)
        if key in inputs and key not in self._sizes:
            return                                # a view or in-place result of an old storage
        if key not in self._sizes:
            self._sizes[key] = t.untyped_storage().nbytes()
            self.live += self._sizes[key]
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= self._sizes.pop(key)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _prompt_lens(num_tokens: int, max_len: int) -> list[int]:
    return [max_len] * (num_tokens // max_len) + [num_tokens % max_len] * bool(num_tokens % max_len)


def profile_batch(num_tokens: int, max_len: int, block_size: int, device: torch.device,
                  staged: bool, piece_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Input ids, positions and metadata of prompts totalling ``num_tokens`` tokens, each at
    most ``max_len`` long, on consecutive blocks from block 0 (staging slot ``i`` for
    prompt ``i`` when ``staged``)."""
    lens = _prompt_lens(num_tokens, max_len)
    blocks = [cdiv(n, block_size) for n in lens]
    first = [sum(blocks[:i]) for i in range(len(lens))]
    tables = [list(range(f, f + b)) for f, b in zip(first, blocks)]
    meta = AttentionMetadata.build(block_size, tables, lens, lens, device,
                                   list(range(len(lens))) if staged else None, piece_dtype)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    return torch.zeros(num_tokens, dtype=torch.long, device=device), positions, meta


def activation_peak(args: ModelArgs, dtype: torch.dtype, device: torch.device, *,
                    k_dtype: str, v_dtype: str, k_scale: str, block_size: int, num_tokens: int,
                    num_logit_rows: int, max_len: int | None = None,
                    layer_dtypes: LayerDtypes | None = None) -> int:
    """Peak activation bytes of one step of ``num_tokens`` prompt tokens plus logits for
    ``num_logit_rows`` rows, replayed under ``FakeTensorMode`` (nothing is computed) on the
    path the engine runs: the same KV codecs and, for per-block key scales, the staging
    slots. One layer per distinct KV format is replayed (at least two layers). Single-token
    queries (a ``max_len`` that does not divide the budget can leave one) take the gathered
    SDPA decode: the native kernel cannot read fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    max_len = min(max_len or args.max_position_embeddings, args.max_position_embeddings)
    names = layer_dtype_names(args.num_layers, k_dtype, v_dtype, layer_dtypes)
    layers = sorted({names.index(pair) for pair in names} | set(range(min(args.num_layers, 2))))
    staged = Staging.needed(k_dtype, v_dtype, args.head_dim, k_scale, layer_dtypes)
    with FakeTensorMode():
        model = Transformer(dataclasses.replace(args, num_layers=len(layers)), dtype, device)
        lens = _prompt_lens(num_tokens, max_len)
        cache = PagedKVCache(num_layers=args.num_layers,
                             num_blocks=sum(cdiv(n, block_size) for n in lens),
                             block_size=block_size, num_kv_heads=args.num_kv_heads,
                             head_dim=args.head_dim, k_dtype=k_dtype, v_dtype=v_dtype,
                             k_scale=k_scale, device=device, layer_dtypes=layer_dtypes)
        staging = Staging(cache, len(lens), dtype) if staged else None
        # Fake tensors take the torch paths (no kernel reads them): on CUDA their gathered
        # prefix copies make this an upper bound of what the Triton kernels need.
        attention = PagedAttention(cache, args.num_heads, args.head_dim ** -0.5, dtype,
                                   staging=staging, backend="sdpa")
        with LiveBytes() as tracker:  # the step's inputs and metadata count too
            ids, positions, meta = profile_batch(num_tokens, max_len, block_size, device,
                                                 staged, dtype)
            hidden = model(ids, positions,
                           lambda i, q, k, v: attention(layers[i], q, k, v, meta))
            logits = model.compute_logits(hidden[:min(num_logit_rows, num_tokens)])
            del hidden, logits
    return tracker.peak


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers, each storage counted once (tied weights)."""
    storages = {_key(t): t.untyped_storage().nbytes()
                for t in [*model.parameters(), *model.buffers()]}
    return sum(storages.values())


def kv_budget(free: int, total: int, fraction: float, activation_bytes: int) -> int:
    """Bytes left for the KV pool when the engine may use ``fraction`` of a device of
    ``total`` bytes, ``total - free`` of which are already used (the loaded weights, the
    CUDA context, other processes), and a step needs ``activation_bytes`` on top (vLLM's
    ``gpu_memory_utilization``)."""
    return int(fraction * total) - (total - free) - activation_bytes


def device_kv_budget(device: torch.device, fraction: float, activation_bytes: int) -> int:
    """:func:`kv_budget` from the device's free and total memory (CUDA only)."""
    if device.type != "cuda":
        raise ConfigError(f"kv_cache.memory_gb: unset (null) sizes the pool from free device "
                          f"memory, which needs a CUDA device; on {device} set memory_gb or "
                          "num_blocks")
    free, total = torch.cuda.mem_get_info(device)
    return kv_budget(free, total, fraction, activation_bytes)
