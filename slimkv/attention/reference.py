"""The reference attention over the paged pool: the oracle every backend and kernel is
checked against, and the backend of last resort (the fallback) when no fast path can run."""

from __future__ import annotations

import torch
from torch import Tensor

from slimkv.attention.backend import AttentionBackend, Staged
from slimkv.attention.metadata import AttentionMetadata
from slimkv.attention.prefill import context_mask
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging


def sequence_context(cache: PagedKVCache, staging: Staging | None, layer: int,
                     meta: AttentionMetadata, i: int, dtype: torch.dtype,
                     staged: Staged | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Sequence ``i``'s keys and values ``[1, n, H, D]`` and mask ``[1, query_len, n]``:
    its pool blocks, or for a staged cache its earlier blocks from the pool and its own
    block at full precision (``staged[i]`` for a prefill chunk, else its staging slot)."""
    if staging is None:
        k, v = cache.read_prefix(layer, meta.block_tables[i:i + 1], meta.seq_lens[i], dtype)
        return k, v, context_mask(meta.seq_lens_t[i:i + 1], meta.query_lens[i], k.shape[1])
    return staging.context(layer, meta.block_tables[i:i + 1], meta.seq_lens[i],
                           meta.query_lens[i], meta.staging_slots[i:i + 1],
                           (staged or {}).get(i), dtype)


def reference_paged_attention(cache: PagedKVCache, layer: int, q: Tensor, meta: AttentionMetadata,
                              scale: float, dtype: torch.dtype, staging: Staging | None = None,
                              staged: Staged | None = None) -> Tensor:
    """Plain per-sequence attention over the cached KV, softmax in float32.

    Reads the pool only (the step's K/V must already be written), plus, for a staged cache,
    each prefill chunk's full-precision K/V (``staged``, what the layer's write returned)
    and each decode's staging slot. Kept simple on purpose: it is the oracle that the
    backends and kernels are checked against.
    """
    out = torch.empty(q.shape, dtype=dtype, device=q.device)
    group = q.shape[1] // cache.num_kv_heads
    for i, q_len in enumerate(meta.query_lens):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i] + q_len)
        k, v, mask = sequence_context(cache, staging, layer, meta, i, torch.float32, staged)
        k = k[0].repeat_interleave(group, dim=1)
        v = v[0].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[rows].float(), k) * scale
        probs = scores.masked_fill(~mask[0], float("-inf")).softmax(dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v).to(dtype)
    return out


class ReferenceBackend(AttentionBackend):
    """Every query through :func:`reference_paged_attention` (the path ``reference``)."""

    decode_path = prefill_path = "reference"

    def attend(self, layer: int, q: Tensor, meta: AttentionMetadata,
               staged: Staged) -> tuple[Tensor, tuple[str, ...]]:
        return reference_paged_attention(self.cache, layer, q, meta, self.scale, self.dtype,
                                         self.staging, staged), ("reference",)
