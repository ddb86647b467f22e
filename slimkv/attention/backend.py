"""What every attention backend shares: the step's cache write, and one layer's attention as
that write followed by the decodes and the prefill chunks.

A backend is chosen once, when the engine is built (:func:`slimkv.attention.layer.select_backend`),
and reads the step's :class:`~slimkv.attention.metadata.AttentionMetadata` without changing
it. What one layer's write produces for its own attention (each prefill chunk's K/V at full
precision, for a staged cache) is returned and passed on, never stored in the metadata.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from slimkv.attention.metadata import AttentionMetadata, DecodePlan, PrefillChunk
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import StagedKV, Staging

# Per prefill chunk (by sequence index), its K/V at full precision from the start of its
# first block: what a staged cache's write gives that layer's prefill attention.
Staged = dict[int, StagedKV]


@functools.cache
def hadamard(dim: int, device: torch.device) -> Tensor:
    """The orthonormal Sylvester Hadamard matrix ``[dim, dim]`` float32 (``dim`` a power of
    two): symmetric, so its own inverse. Issue 46's rotations of K and V use it."""
    if dim & (dim - 1):
        raise ValueError(f"kv_cache.int4 rotations need a power-of-two head_dim, got {dim}")
    # Sylvester's H[i, j] = (-1) ** popcount(i & j)
    h = torch.tensor([[(-1.0) ** bin(i & j).count("1") for j in range(dim)] for i in range(dim)])
    return (h * dim ** -0.5).to(device)


class AttentionBackend:
    """Cache write + attention for one model's layers over one :class:`PagedKVCache`.

    Subclasses set the paths they count (``decode_path``, ``prefill_path``) and implement
    :meth:`decode` and :meth:`prefill`; ``piece_dtype`` is the dtype of the prefill pieces'
    masks a backend wants planned in the metadata (None: it plans none).
    ``kernel_unavailable`` / ``fallback_reason``: why a faster backend was not chosen."""

    decode_path = prefill_path = ""
    piece_dtype: torch.dtype | None = None

    @staticmethod
    def unavailable(cache: PagedKVCache) -> str | None:
        """Why this backend cannot run over ``cache`` (None: it can)."""
        return None

    def one_call_step(self, model: torch.nn.Module, attention) -> None:
        """What runs a step of decodes through every layer in one call, if anything can."""
        return None

    def __init__(self, cache: PagedKVCache, staging: Staging | None, num_heads: int,
                 scale: float, dtype: torch.dtype, *, kernel_unavailable: str | None = None,
                 fallback_reason: str | None = None) -> None:
        self.cache, self.staging, self.num_heads = cache, staging, num_heads
        self.scale, self.dtype = scale, dtype
        self.kernel_unavailable, self.fallback_reason = kernel_unavailable, fallback_reason

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                meta: AttentionMetadata) -> tuple[Tensor, tuple[str, ...]]:
        """``q [T, Hq, D]``, ``k, v [T, H_kv, D]`` (any float dtype, taken as rounded to
        ``dtype``) -> (``[T, Hq, D]`` in ``dtype``, the paths taken)."""
        q, k, v = (x.to(self.dtype) for x in (q, k, v))
        return self.attend(layer, q, meta, self.write(layer, k, v, meta))

    def rotate(self, x: Tensor) -> Tensor:
        """``x [T, heads, D]`` times :func:`hadamard` per head, in float32 (returned in
        ``x``'s dtype). The CPU backend does it in C, as its one-call step does."""
        return (x.float() @ hadamard(x.shape[-1], x.device)).to(x.dtype)

    def write(self, layer: int, k: Tensor, v: Tensor, meta: AttentionMetadata) -> Staged:
        """Store the step's K/V: token by token, or through the staging slots (decodes at
        once; each prefill chunk's full-precision K/V returned for this layer's attention)."""
        if self.staging is None:
            self.cache.write(layer, meta.slot_mapping, k, v)
            return {}
        plan, bs = meta.decode, self.cache.block_size
        if plan is not None:
            self.staging.append_decodes(layer, plan.staging_slots, plan.offsets,
                                        plan.last_block_id, k[plan.rows], v[plan.rows],
                                        plan.filled)
        return {c.seq: self.staging.append(layer, meta.staging_slot_ids[c.seq], c.start,
                                           meta.block_tables[c.seq, c.start // bs:],
                                           k[c.rows], v[c.rows])
                for c in meta.prefills}

    def attend(self, layer: int, q: Tensor, meta: AttentionMetadata,
               staged: Staged) -> tuple[Tensor, tuple[str, ...]]:
        """The step's queries over the pool the write has filled."""
        out, paths = torch.empty_like(q), ()
        if meta.decode is not None:
            self.decode(layer, q, meta.decode, out)
            paths = (self.decode_path,)
        for chunk in meta.prefills:
            out[chunk.rows] = self.prefill(layer, q[chunk.rows], chunk, staged.get(chunk.seq),
                                           meta)
        return out, paths + ((self.prefill_path,) if meta.prefills else ())

    def decode(self, layer: int, q: Tensor, plan: DecodePlan, out: Tensor) -> None:
        """Fill ``out[plan.rows]`` with the single-token queries' attention."""
        raise NotImplementedError

    def prefill(self, layer: int, q: Tensor, chunk: PrefillChunk, staged: StagedKV | None,
                meta: AttentionMetadata) -> Tensor:
        """One chunk's ``q [n, Hq, D]`` over its context -> ``[n, Hq, D]``."""
        raise NotImplementedError
