"""Paged attention over the quantized KV pool.

Every layer call first writes the step's new K/V into the pool, then attends each query
over its sequence's KV read back *from the pool*. Prefill chunks, prefix-cached blocks and
decodes therefore all see the same quantized values, and the result does not depend on how
a prompt was chunked.

With per-block scales the cache is *staged* (:mod:`slimkv.kv.staging`): a query sees the
blocks before its own through the pool and its own block at full precision, from the
staging slot for a decode, from the chunk's own tokens (plus the staged head of its first
block) for a prefill. That rule depends on positions only, so chunking still does not
change results.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict

import torch
import torch.nn.functional as F
from torch import Tensor

from slimkv.attention import prefill
from slimkv.attention.metadata import AttentionMetadata, DecodePlan
from slimkv.attention.prefill import context_mask
from slimkv.attention.reference import reference_paged_attention, sequence_context
from slimkv.kernels import (KVSide, decode_kernel, describe, kernel_format,
                            kernel_unavailable_reason)
from slimkv.kernels.stage import KINDS, stage_kernel
from slimkv.kernels.triton import triton_unavailable_reason
from slimkv.kernels.triton.side import describe as triton_side
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.quant import FloatCodec
from slimkv.kv.staging import Staging

__all__ = ["FAST_ENV", "AttentionMetadata", "DecodePlan", "PagedAttention",
           "reference_paged_attention", "sequence_context"]

# Set to 0 to force the reference (fallback) path, e.g. to prove `slimkv verify` catches it.
FAST_ENV = "SLIMKV_ATTENTION_FAST"


def _gqa_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Masked attention for ``q [B, n, Hq, D]`` over ``k, v [B, L, H_kv, D]``, ``mask [B, n, L]``.

    The ``Hq // H_kv`` query heads sharing a KV head are folded into the query axis, so each
    KV head is used as is (no repeat_interleave copy of K/V) in a single SDPA call.
    """
    batch, n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    q = q.view(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * n, head_dim)
    mask = mask.unsqueeze(1).expand(batch, group, n, -1).reshape(batch, 1, group * n, -1)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    out = out.view(batch, num_kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, n, num_heads, head_dim)


class PagedAttention:
    """Cache write + attention for one model's layers, sharing one :class:`PagedKVCache`.

    On the CPU, decodes (query_len 1) of a step run together through the fused C kernel of
    :mod:`slimkv.kernels` (``fused_decode``: gather, dequantize and attend without a float
    copy of the cache) and each prefill chunk as SDPA pieces over its dequantized context
    (``fast_prefill``). On CUDA (``triton``) the Triton kernels of
    :mod:`slimkv.kernels.triton` read the pool's pages in place for both (``triton_decode``,
    ``triton_prefill``) and the pool's writes go through them too. Where no decode kernel
    can run (``kernel_unavailable``) decodes are one batched SDPA over their gathered,
    dequantized blocks (``fast_decode``). ``fast=False`` (default: the
    ``SLIMKV_ATTENTION_FAST`` environment variable, on unless ``0``) or a KV format the device
    cannot decode (``fallback_reason``) runs :func:`reference_paged_attention` instead: the
    fallback. ``path_counts`` counts, per layer call, each path taken; ``layer_path_counts``
    the same per layer.
    """

    def __init__(self, cache: PagedKVCache, num_heads: int, scale: float, dtype: torch.dtype,
                 fast: bool | None = None, staging: Staging | None = None,
                 triton: bool | None = None) -> None:
        if num_heads % cache.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={cache.num_kv_heads}")
        self.cache = cache
        self.staging = staging
        self.num_heads = num_heads
        self.scale = scale
        self.dtype = dtype
        self.fast = os.environ.get(FAST_ENV, "1") != "0" if fast is None else fast
        self.path_counts: Counter[str] = Counter()
        self.layer_path_counts: defaultdict[int, Counter[str]] = defaultdict(Counter)
        # Triton kernels on CUDA; on the CPU when asked (tests, under TRITON_INTERPRET=1).
        self.triton = cache.device.type == "cuda" if triton is None else triton
        self.fallback_reason = self._fallback_reason()
        self.kernel_unavailable = self._kernel_unavailable()
        self._sides: dict[int, tuple[KVSide, KVSide]] = {}  # per layer, made on first use
        # The lean decode (decodes only, fused kernel): in each layer (_lean_decode) for a
        # staged cache; in the one-call step (slimkv.kernels.step) also for an unstaged pool
        # stored in the model dtype, which the stage kernel writes as it writes staging.
        lean = not self.triton and self.fallback_reason is None and dtype in KINDS and (
            staging.buffer.dtype == dtype if staging is not None else
            all(isinstance(c, FloatCodec) and c.storage_dtype == dtype for c in cache.all_codecs()))
        self._stage = stage_kernel() if lean else None
        self._q = torch.empty(0)
        self._triton_prefill = None  # set with the Triton decode
        self._kernel = None if self.kernel_unavailable is not None else (
            self._triton_kernels() if self.triton else decode_kernel())

    def _triton_kernels(self):
        """The Triton decode; the pool's writes go through its kernels too."""
        from slimkv.kernels.triton.decode import TritonDecode
        from slimkv.kernels.triton.pool import TritonPoolWriter
        from slimkv.kernels.triton.prefill import paged_prefill

        self.cache.writer = TritonPoolWriter(self.cache)
        self._triton_prefill = paged_prefill
        return TritonDecode()

    def _fallback_reason(self) -> str | None:
        """Why the fast quantized path cannot run (None when it can): disabled, or a KV
        format whose storage this device cannot decode (e.g. fp8 without float8 support)."""
        if not self.fast:
            return f"the fast attention path is disabled (fast=False or {FAST_ENV}=0)"
        for codec in self.cache.all_codecs():
            probe = torch.zeros(1, self.cache.block_size, 1, codec.head_dim,
                                device=self.cache.device)
            try:
                codec.dequantize(codec.quantize(probe), self.dtype)
            except (RuntimeError, TypeError) as exc:
                return f"{codec.name} KV cannot be decoded on {self.cache.device}: {exc}"
        return None

    def _kernel_unavailable(self) -> str | None:
        """Why decodes cannot use a kernel over the pool (None if they can): the C kernel of
        :mod:`slimkv.kernels` on the CPU, the Triton one (:mod:`slimkv.kernels.triton`)."""
        if any(kernel_format(codec) is None for codec in self.cache.all_codecs()):
            return "the decode kernels lack this KV format"
        if self.triton:
            return triton_unavailable_reason(self.cache.device)
        if self.cache.device.type != "cpu":
            return f"the fused C decode kernel is CPU-only (device {self.cache.device})"
        return kernel_unavailable_reason()

    @property
    def decode_path(self) -> str:
        """The path decodes take: ``fused_decode`` (the C kernel), ``triton_decode``,
        ``fast_decode`` (gather + SDPA) or ``reference`` (the fallback)."""
        if self.fallback_reason is not None:
            return "reference"
        if self.kernel_unavailable is not None:
            return "fast_decode"
        return "triton_decode" if self.triton else "fused_decode"

    def _count(self, layer: int, path: str) -> None:
        self.path_counts[path] += 1
        self.layer_path_counts[layer][path] += 1

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        """``q [T, num_heads, D]``, ``k, v [T, H_kv, D]`` (any float dtype, taken as rounded
        to ``dtype``) -> ``[T, num_heads, D]`` in ``dtype``."""
        plan = meta.decode
        if self.staging is not None and self.can_lean(plan):
            return self._lean_decode(layer, q, k, v, plan)
        q, k, v = (x.to(self.dtype) for x in (q, k, v))
        self._write(layer, k, v, meta)
        if self.fallback_reason is not None:
            self._count(layer, "reference")
            return reference_paged_attention(self.cache, layer, q, meta, self.scale, self.dtype,
                                             self.staging)
        out = torch.empty_like(q)
        if plan is not None:
            if self.kernel_unavailable is None:
                self._count(layer, self.decode_path)
                self._fused_decode(layer, q, plan, out)
            else:
                self._count(layer, "fast_decode")
                self._decode(layer, q, plan, out)
        prefills = [i for i, n in enumerate(meta.query_lens) if n > 1]
        if prefills:
            self._count(layer, "fast_prefill" if self._triton_prefill is None else "triton_prefill")
        for i in prefills:
            rows = slice(meta.query_start_loc[i], meta.query_start_loc[i] + meta.query_lens[i])
            out[rows] = self._prefill(layer, q[rows], meta, i)
        return out

    def _prefill(self, layer: int, q: Tensor, meta: AttentionMetadata, i: int) -> Tensor:
        """Sequence ``i``'s chunk: the pool's pages read in place by the Triton kernel, or in
        the pieces planned for it by the step's first layer over a dequantized copy."""
        staged = None if self.staging is None else meta.staged[i]
        if self._triton_prefill is not None:
            return self._triton_prefill(q, meta.block_tables[i], meta.seq_lens[i],
                                        *self._layer_sides(layer), staged, self.scale)
        k, v = self.cache.read_prefix(layer, meta.block_tables[i:i + 1], meta.seq_lens[i],
                                      self.dtype)
        if i not in meta.prefill_pieces:
            meta.prefill_pieces[i] = prefill.plan(meta.seq_lens[i], len(q),
                                                  None if staged is None else staged.start,
                                                  self.cache.block_size, self.dtype, q.device)
        return prefill.run(meta.prefill_pieces[i], q, k[0], v[0], staged, self.scale)

    def _write(self, layer: int, k: Tensor, v: Tensor, meta: AttentionMetadata) -> None:
        """Store the step's K/V: token by token, or through the staging slots (decodes at
        once; each prefill's full-precision K/V kept in ``meta.staged`` for this layer)."""
        if self.staging is None:
            self.cache.write(layer, meta.slot_mapping, k, v)
            return
        plan, bs = meta.decode, self.cache.block_size
        if plan is not None:
            self.staging.append_decodes(layer, plan.staging_slots, plan.offsets,
                                        plan.last_block_id, k[plan.rows], v[plan.rows],
                                        plan.filled)
        meta.staged = {}
        for i, q_len in enumerate(meta.query_lens):
            if q_len > 1:
                start = meta.seq_lens[i] - q_len
                rows = slice(meta.query_start_loc[i], meta.query_start_loc[i] + q_len)
                meta.staged[i] = self.staging.append(layer, meta.staging_slot_ids[i], start,
                                                     meta.block_tables[i, start // bs:],
                                                     k[rows], v[rows])

    def _lean_decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                     plan: DecodePlan) -> Tensor:
        """A step of decodes only, staged cache, fused kernel: one C call stages K/V and
        rounds Q (:mod:`slimkv.kernels.stage`), full blocks go to the pool, then attend."""
        self._count(layer, "fused_decode")
        take = self._stage.takes
        if not (take(q) and take(k) and take(v)):
            q, k, v = (x if take(x) else x.float().contiguous() for x in (q, k, v))
        if self._q.shape != q.shape:  # one float32 Q buffer, reused by every layer
            self._q = torch.empty(q.shape, dtype=torch.float32)
        stage_k, stage_v = self.staging.layer_buffers(layer)
        slots = plan.staging_slots
        q = self._stage(q, k, v, self.dtype, stage_k, stage_v, slots, plan.offsets, self._q)
        if plan.filled is not None:
            self.staging.store_filled(layer, slots, plan.last_block_id, plan.filled)
        k_side, v_side = self._sides.get(layer) or self._layer_sides(layer)
        return self._kernel(q, plan.block_tables, plan.seq_lens, k_side, v_side,
                            self.cache.num_kv_heads, self.cache.block_size, self.scale,
                            (stage_k, stage_v, slots)).to(self.dtype)

    def can_lean(self, plan: DecodePlan | None) -> bool:
        """Whether the step (``meta.decode``) is decodes only and takes the lean decode."""
        return plan is not None and plan.whole and self._stage is not None and \
            not self.kernel_unavailable

    def lean_layer(self, layer: int) -> tuple[Tensor, Tensor, KVSide, KVSide]:
        """Where a layer's new K, V go (staging, else the pool) and its pool sides, for the
        one-call decode step (slimkv.kernels.step): :meth:`_lean_decode`, or the cache
        write then :meth:`_fused_decode`, in every layer."""
        buffers = self.staging.layer_buffers(layer) if self.staging is not None else tuple(
            self.cache.layer_pool(side, layer).data for side in ("k", "v"))
        return (*buffers, *self._layer_sides(layer))

    def after_lean_step(self, plan: DecodePlan) -> None:
        """After that step: filled blocks into the pool (its kernel read them from the
        staging slots), the path counted for every layer."""
        self.path_counts["fused_decode"] += self.cache.num_layers
        for layer in range(self.cache.num_layers):
            self.layer_path_counts[layer]["fused_decode"] += 1
        if self.staging is not None:
            self.staging.store_filled_all_layers(plan.staging_slots, plan.last_block_id,
                                                 plan.filled)

    def _fused_decode(self, layer: int, q: Tensor, plan: DecodePlan, out: Tensor) -> None:
        buffers = None if self.staging is None else self.staging.layer_buffers(layer)
        out[plan.rows] = self._attend(layer, q[plan.rows].float(), plan, buffers).to(self.dtype)

    def _attend(self, layer: int, q: Tensor, plan: DecodePlan,
                buffers: tuple[Tensor, Tensor] | None) -> Tensor:
        """The fused kernel over float32 ``q [n, Hq, D]`` of the plan's decodes."""
        return self._kernel(q, plan.block_tables, plan.seq_lens, *self._layer_sides(layer),
                            self.cache.num_kv_heads, self.cache.block_size, self.scale,
                            None if buffers is None else (*buffers, plan.staging_slots))

    def _layer_sides(self, layer: int) -> tuple[KVSide, KVSide]:
        """The kernel's view of the layer's K and V pools, made on first use."""
        if layer not in self._sides:
            view = triton_side if self.triton else describe
            self._sides[layer] = tuple(view(self.cache.layer_codecs[layer][side],
                                            self.cache.layer_pool(side, layer))
                                       for side in ("k", "v"))
        return self._sides[layer]

    def _decode(self, layer: int, q: Tensor, plan: DecodePlan, out: Tensor) -> None:
        """All single-token queries at once; the key-padding mask comes from seq_lens. A
        staged cache's last blocks come from the staging slots."""
        k, v = self.cache.read_prefix(layer, plan.block_tables, plan.max_len, self.dtype)
        if self.staging is not None:
            self.staging.overlay(layer, k, v, plan.staging_slots, plan.last_block)
        mask = context_mask(plan.seq_lens, 1, k.shape[1])
        out[plan.rows] = _gqa_sdpa(q[plan.rows].unsqueeze(1), k, v, mask, self.scale).squeeze(1)
