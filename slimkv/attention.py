"""Paged attention over the quantized KV pool.

Every layer call first writes the step's new K/V into the pool, then attends each query
over its sequence's KV read back *from the pool*. Prefill chunks, prefix-cached blocks and
decodes therefore all see the same quantized values, and the result does not depend on how
a prompt was chunked.

With per-block scales (a staged cache, :mod:`slimkv.kv.staging`) a query sees the blocks
before its own through the pool and its own block at full precision: from the staging slot
for a decode, from the chunk's own tokens (plus the staged head of its first block) for a
prefill. That rule depends on positions only, so chunking still does not change results.
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from slimkv.kernels import (KVSide, decode_kernel, describe, kernel_format,
                            kernel_unavailable_reason)
from slimkv.kv.cache import PagedKVCache
from slimkv.own_block import Fresh, staged_context

# Set to 0 to force the reference (fallback) path, e.g. to prove `slimkv verify` catches it.
FAST_ENV = "SLIMKV_ATTENTION_FAST"


@dataclass(slots=True)
class AttentionMetadata:
    """Where a step's tokens go and what each sequence attends to.

    The step's tokens are laid out sequence after sequence: sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]``; they are the *last* ``query_lens[i]`` tokens
    of its ``seq_lens[i]``-token context, whose KV lives in the blocks ``block_tables[i]``.
    """

    slot_mapping: torch.Tensor      # [T] int64: block_id * block_size + offset of each new token
    query_start_loc: list[int]      # [B + 1] cumulative query lengths
    query_lens: list[int]           # [B] new tokens per sequence this step
    seq_lens: list[int]             # [B] context length per sequence after this step
    block_tables: torch.Tensor      # [B, max_blocks] int64, padded with 0 past each table's end
    seq_lens_t: torch.Tensor        # [B] int64, seq_lens on the device
    staging_slots: torch.Tensor | None = None  # [B] int64: staging slot per sequence


def _context_mask(seq_lens: Tensor, query_len: int, num_keys: int) -> Tensor:
    """``[B, query_len, num_keys]`` bool, True where a query may attend a key.

    Query ``i`` of a sequence of length ``L`` sits at absolute position ``L - query_len + i``
    and sees keys at or before it, so padding past ``L`` (block tails, padded block tables
    of shorter sequences) is never attended.
    """
    query_pos = seq_lens[:, None] - query_len + torch.arange(query_len, device=seq_lens.device)
    key_pos = torch.arange(num_keys, device=seq_lens.device)
    return key_pos[None, None, :] <= query_pos[:, :, None]


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


def reference_paged_attention(cache: PagedKVCache, layer: int, q: Tensor, meta: AttentionMetadata,
                              scale: float, dtype: torch.dtype,
                              fresh: dict[int, Fresh] | None = None) -> Tensor:
    """Plain per-sequence attention over the cached KV, softmax in float32.

    Reads the pool only (the step's K/V must already be written), plus, for a staged cache,
    each prefill's ``fresh`` K/V (:attr:`PagedAttention.fresh`) and each decode's staging
    slot. Kept simple on purpose: it is the oracle that the fast path and future kernels
    are checked against.
    """
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    group = q.shape[1] // cache.num_kv_heads
    fresh = fresh or {}
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i] + q_len)
        if cache.staging is None:
            k, v = cache.read_prefix(layer, meta.block_tables[i:i + 1], seq_len, torch.float32)
            mask = _context_mask(meta.seq_lens_t[i:i + 1], q_len, k.shape[1])
        else:
            k, v, mask = staged_context(cache, layer, meta.block_tables[i:i + 1], seq_len, q_len,
                                        meta.staging_slots[i:i + 1], fresh.get(i), torch.float32)
        k = k[0].repeat_interleave(group, dim=1)
        v = v[0].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k) * scale
        probs = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v).to(dtype)
    return out


@dataclass(slots=True)
class DecodePlan:
    """A step's single-token queries, gathered once per step for all layers."""

    seqs: list[int]                 # their sequence indices in the batch
    rows: Tensor                    # [n] their query rows
    block_tables: Tensor            # [n, m]
    seq_lens: Tensor                # [n]
    max_len: int
    staging_slots: Tensor | None    # [n]
    own_blocks: Tensor              # [n] index in the table of the block holding the new token
    write_blocks: Tensor            # [n] that block's id

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> DecodePlan | None:
        seqs = [i for i, n in enumerate(meta.query_lens) if n == 1]
        if not seqs:
            return None
        device = meta.block_tables.device
        index = torch.tensor(seqs, device=device)
        tables = meta.block_tables[index].contiguous()
        seq_lens = meta.seq_lens_t[index].contiguous()
        own = (seq_lens - 1) // block_size
        slots = None if meta.staging_slots is None else meta.staging_slots[index].contiguous()
        return cls(seqs, torch.tensor([meta.query_start_loc[i] for i in seqs], device=device),
                   tables, seq_lens, max(meta.seq_lens[i] for i in seqs), slots, own,
                   tables.gather(1, own[:, None]).squeeze(1))


class PagedAttention:
    """Cache write + attention for one model's layers, sharing one :class:`PagedKVCache`.

    Decodes (query_len 1) of a step run together: on the CPU through the fused kernel of
    :mod:`slimkv.kernels` (``fused_decode``: gather, dequantize and attend without a float
    copy of the cache), elsewhere, or when the kernel cannot be built
    (``kernel_unavailable``), as one batched SDPA over their gathered, dequantized blocks
    (``fast_decode``). Each prefill (chunk) is one SDPA with an offset causal mask
    (``fast_prefill``). ``fast=False`` (default: the ``SLIMKV_ATTENTION_FAST`` environment
    variable, on unless ``0``) or a KV format the device cannot decode (``fallback_reason``)
    runs :func:`reference_paged_attention` instead: the fallback. ``path_counts`` counts,
    per layer call, each path taken; ``layer_path_counts`` the same per layer.
    """

    def __init__(self, cache: PagedKVCache, num_heads: int, scale: float, dtype: torch.dtype,
                 fast: bool | None = None) -> None:
        if num_heads % cache.num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of "
                             f"num_kv_heads={cache.num_kv_heads}")
        self.cache = cache
        self.num_heads = num_heads
        self.scale = scale
        self.dtype = dtype
        self.fast = os.environ.get(FAST_ENV, "1") != "0" if fast is None else fast
        self.fresh: dict[int, Fresh] = {}  # the last call's prefills' full-precision K/V
        self.path_counts: Counter[str] = Counter()
        self.layer_path_counts: defaultdict[int, Counter[str]] = defaultdict(Counter)
        self.fallback_reason = self._fallback_reason()
        self.kernel_unavailable = self._kernel_unavailable()
        self._sides: dict[int, tuple[KVSide, KVSide]] = {}  # per layer, made on first use
        self._plan: tuple[AttentionMetadata, DecodePlan | None] | None = None

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
        """Why decodes cannot use the fused kernel of :mod:`slimkv.kernels` (None if they can)."""
        if self.cache.device.type != "cpu":
            return f"the fused decode kernel is CPU-only (device {self.cache.device})"
        if any(kernel_format(codec) is None for codec in self.cache.all_codecs()):
            return "the fused decode kernel lacks this KV format"
        return kernel_unavailable_reason()

    def _count(self, layer: int, path: str) -> None:
        self.path_counts[path] += 1
        self.layer_path_counts[layer][path] += 1

    def _decode_plan(self, meta: AttentionMetadata) -> DecodePlan | None:
        """The step's :class:`DecodePlan`, built by its first layer call."""
        if self._plan is None or self._plan[0] is not meta:
            self._plan = (meta, DecodePlan.build(meta, self.cache.block_size))
        return self._plan[1]

    def __call__(self, layer: int, q: Tensor, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Tensor:
        """``q [T, num_heads, D]``, ``k, v [T, H_kv, D]`` -> ``[T, num_heads, D]`` in ``dtype``."""
        plan = self._decode_plan(meta)
        self._write(layer, k, v, meta, plan)
        if self.fallback_reason is not None:
            self._count(layer, "reference")
            return reference_paged_attention(self.cache, layer, q, meta, self.scale, self.dtype,
                                             self.fresh)
        q = q.to(self.dtype)
        out = torch.empty_like(q)
        if plan is not None:
            if self.kernel_unavailable is None:
                self._count(layer, "fused_decode")
                self._fused_decode(layer, q, plan, out)
            else:
                self._count(layer, "fast_decode")
                self._decode(layer, q, plan, out)
        prefills = [i for i, n in enumerate(meta.query_lens) if n > 1]
        if prefills:
            self._count(layer, "fast_prefill")
        for i in prefills:
            self._prefill(layer, q, meta, i, out)
        return out

    def _write(self, layer: int, k: Tensor, v: Tensor, meta: AttentionMetadata,
               plan: DecodePlan | None) -> None:
        """Store the step's K/V: token by token, or through the staging slots (decodes at
        once, each prefill keeping its full-precision K/V in :attr:`fresh`)."""
        staging = self.cache.staging
        if staging is None:
            self.cache.write(layer, meta.slot_mapping, k, v)
            return
        self.fresh = {}
        bs = self.cache.block_size
        if plan is not None:
            staging.append_decodes(layer, plan.staging_slots, plan.seq_lens - 1,
                                   plan.write_blocks, k[plan.rows], v[plan.rows])
        for i, q_len in enumerate(meta.query_lens):
            if q_len > 1:
                start = meta.seq_lens[i] - q_len
                rows = slice(meta.query_start_loc[i], meta.query_start_loc[i] + q_len)
                fresh = staging.append(layer, int(meta.staging_slots[i]), start,
                                       meta.block_tables[i, start // bs:], k[rows], v[rows])
                self.fresh[i] = Fresh(start // bs * bs, *fresh)

    def _fused_decode(self, layer: int, q: Tensor, plan: DecodePlan, out: Tensor) -> None:
        staging = self.cache.staging
        own = None if staging is None else (staging.buffer[0, layer], staging.buffer[1, layer],
                                            plan.staging_slots)
        if layer not in self._sides:
            self._sides[layer] = tuple(describe(self.cache.layer_codecs[layer][side],
                                                self.cache.layer_pool(side, layer))
                                       for side in ("k", "v"))
        result = decode_kernel()(q[plan.rows].float(), plan.block_tables, plan.seq_lens,
                                 *self._sides[layer], self.cache.num_kv_heads,
                                 self.cache.block_size, self.scale, own)
        out[plan.rows] = result.to(self.dtype)

    def _decode(self, layer: int, q: Tensor, plan: DecodePlan, out: Tensor) -> None:
        """All single-token queries at once; the key-padding mask comes from seq_lens. A
        staged cache's own blocks replace theirs from the staging slots."""
        k, v = self.cache.read_prefix(layer, plan.block_tables, plan.max_len, self.dtype)
        if self.cache.staging is not None:
            bs = self.cache.block_size
            batch = torch.arange(len(plan.seqs), device=k.device)
            own_k, own_v = self.cache.staging.own_blocks(layer, plan.staging_slots, self.dtype)
            k.unflatten(1, (-1, bs))[batch, plan.own_blocks] = own_k
            v.unflatten(1, (-1, bs))[batch, plan.own_blocks] = own_v
        mask = _context_mask(plan.seq_lens, 1, k.shape[1])
        out[plan.rows] = _gqa_sdpa(q[plan.rows].unsqueeze(1), k, v, mask, self.scale).squeeze(1)

    def _prefill(self, layer: int, q: Tensor, meta: AttentionMetadata, i: int, out: Tensor) -> None:
        """One prompt (chunk) attending its cached prefix and itself, causally."""
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i] + meta.query_lens[i])
        if self.cache.staging is None:
            k, v = self.cache.read_prefix(layer, meta.block_tables[i:i + 1], meta.seq_lens[i],
                                          self.dtype)
            mask = _context_mask(meta.seq_lens_t[i:i + 1], meta.query_lens[i], k.shape[1])
        else:
            k, v, mask = staged_context(self.cache, layer, meta.block_tables[i:i + 1],
                                        meta.seq_lens[i], meta.query_lens[i],
                                        meta.staging_slots[i:i + 1], self.fresh[i], self.dtype)
        out[rows] = _gqa_sdpa(q[rows].unsqueeze(0), k, v, mask, self.scale).squeeze(0)
