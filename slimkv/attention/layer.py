"""Paged attention for a model's layers: the backend chosen once, and the paths it counts.

Every layer call first writes the step's new K/V into the pool, then attends each query
over its sequence's KV read back *from the pool*. Prefill chunks, prefix-cached blocks and
decodes therefore all see the same quantized values, and the result does not depend on how
a prompt was chunked. With per-block scales the cache is *staged*
(:mod:`slimkv.kv.staging`): a query sees the blocks before its own through the pool and its
own block at full precision. That rule depends on positions only, so chunking still does
not change results.

The backends, one per file: ``sdpa`` (torch, where no kernel can run) and ``reference`` (the
oracle; the fallback) here, and the kernel backends the engine is built with
(:mod:`slimkv.backends`): ``cpu`` (the fused C decode kernel) and ``triton`` (CUDA).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping

import torch
from torch import Tensor

from slimkv.attention.backend import AttentionBackend, hadamard
from slimkv.attention.metadata import AttentionMetadata, DecodePlan
from slimkv.attention.reference import ReferenceBackend
from slimkv.attention.sdpa import SdpaBackend
from slimkv.kernels import kernel_format
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging

# Set to 0 to force the reference (fallback) backend, e.g. to prove `slimkv verify` catches it.
FAST_ENV = "SLIMKV_ATTENTION_FAST"
Kernels = Mapping[str, type[AttentionBackend]]  # the kernel backends an engine was built with


def _undecodable(cache: PagedKVCache, dtype: torch.dtype) -> str | None:
    """Why the pool's KV formats cannot be decoded on its device (None when they can),
    e.g. fp8 without float8 support."""
    for codec in cache.all_codecs():
        probe = torch.zeros(1, cache.block_size, 1, codec.head_dim, device=cache.device)
        try:
            codec.dequantize(codec.quantize(probe), dtype)
        except (RuntimeError, TypeError) as exc:
            return f"{codec.name} KV cannot be decoded on {cache.device}: {exc}"
    return None


def select_backend(cache: PagedKVCache, staging: Staging | None, num_heads: int, scale: float,
                   dtype: torch.dtype, name: str | None = None,
                   kernels: Kernels | None = None) -> AttentionBackend:
    """The backend ``name`` (an error if it cannot run here), or the fastest that can: of
    ``kernels`` (:mod:`slimkv.backends`), ``triton`` on CUDA and ``cpu`` on the CPU, else
    ``sdpa``; ``reference`` when the fast path is disabled (``SLIMKV_ATTENTION_FAST=0``)
    or the KV format cannot be decoded."""
    kernels = kernels or {}
    known = ["reference", "sdpa", *kernels]
    if name is not None and name not in known:
        raise ValueError(f"unknown attention backend {name!r}; one of {', '.join(known)}")
    args = (cache, staging, num_heads, scale, dtype)
    reason = _undecodable(cache, dtype)
    if name == "reference" or (name is None and os.environ.get(FAST_ENV, "1") == "0"):
        reason = f"the fast attention path is disabled (the reference backend, or {FAST_ENV}=0)"
    if reason is not None and name not in (None, "reference"):
        raise ValueError(f"attention backend {name!r} cannot run: {reason}")
    if reason is not None:
        return ReferenceBackend(*args, fallback_reason=reason)
    kernel = name or ("triton" if cache.device.type == "cuda" else "cpu")
    if kernel == "sdpa":
        reason = "the sdpa backend was asked for"
    elif any(kernel_format(codec) is None for codec in cache.all_codecs()):
        reason = "the decode kernels lack this KV format"
    elif kernel not in kernels:
        reason = f"this engine was built without the {kernel} backend (slimkv.backends)"
    else:
        reason = kernels[kernel].unavailable(cache)
    if reason is None:
        return kernels[kernel](*args)
    if name not in (None, "sdpa"):
        raise ValueError(f"attention backend {name!r} cannot run: {reason}")
    return SdpaBackend(*args, kernel_unavailable=reason)


class PagedAttention:
    """Cache write + attention for one model's layers, sharing one :class:`PagedKVCache`,
    through the backend chosen when it is built (``backend``: a backend's name; None:
    :func:`select_backend`'s choice among the core's and ``kernels``). ``path_counts``
    counts, per layer call, each path taken; ``layer_path_counts`` the same per layer.

    ``rotate`` (``kv_cache.int4``'s ``rotate_k``, and ``rotate_v`` unless the loader folded
    it into the weights): in each layer whose K is int4, Q and K are rotated by the backend's
    :meth:`~slimkv.attention.backend.AttentionBackend.rotate` after RoPE, before the write
    (q.k is unchanged, the keys' outlier channels spread over all of them); where V is int4,
    V before the write and the output after the attention (o = o' R^T; R is symmetric)."""

    def __init__(self, cache: PagedKVCache, num_heads: int, scale: float, dtype: torch.dtype,
                 staging: Staging | None = None, backend: str | None = None,
                 kernels: Kernels | None = None, rotate: tuple[bool, bool] = (False, False)
                 ) -> None:
        if num_heads % cache.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={cache.num_kv_heads}")
        self.backend = select_backend(cache, staging, num_heads, scale, dtype, backend, kernels)
        self.cache, self.staging, self.num_heads = cache, staging, num_heads
        self.scale, self.dtype = scale, dtype
        self.path_counts: Counter[str] = Counter()
        self.layer_path_counts: defaultdict[int, Counter[str]] = defaultdict(Counter)
        self.rotate = [(rotate[0] and c["k"].name == "int4", rotate[1] and c["v"].name == "int4")
                       for c in cache.layer_codecs]  # per layer: (Q and K, V and the output)
        if any(map(any, self.rotate)):
            hadamard(cache.head_dim, cache.device)  # a head_dim it cannot rotate fails here

    @property
    def decode_path(self) -> str:
        """``fused_decode``, ``triton_decode``, ``fast_decode`` or ``reference``."""
        return self.backend.decode_path

    def count(self, layer: int, paths: Iterable[str]) -> None:
        for path in paths:
            self.path_counts[path] += 1
            self.layer_path_counts[layer][path] += 1

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                 meta: AttentionMetadata) -> Tensor:
        """``q [T, num_heads, D]``, ``k, v [T, H_kv, D]`` -> ``[T, num_heads, D]`` in ``dtype``."""
        rotate_k, rotate_v = self.rotate[layer]
        if rotate_k:
            q, k = self.backend.rotate(q), self.backend.rotate(k)
        out, paths = self.backend.forward(layer, q, k, self.backend.rotate(v) if rotate_v else v,
                                          meta)
        self.count(layer, paths)
        return self.backend.rotate(out) if rotate_v else out

    def after_lean_step(self, plan: DecodePlan) -> None:
        """After a one-call decode step (:mod:`slimkv.backends.cpu_step`): the backend's
        bookkeeping, and the path counted for every layer."""
        self.backend.after_lean_step(plan)
        for layer in range(self.cache.num_layers):
            self.count(layer, (self.decode_path,))
