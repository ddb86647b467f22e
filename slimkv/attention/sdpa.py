"""The torch backend: decodes as one batched SDPA over their gathered, dequantized blocks
(``fast_decode``), prefill chunks as SDPA pieces over the chunk's dequantized context
(``fast_prefill``, :mod:`slimkv.attention.prefill`). It runs wherever torch does: where no
decode kernel can (a device without one, a format the kernels lack, the start-up replay
under fake tensors)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from slimkv.attention import prefill
from slimkv.attention.backend import AttentionBackend
from slimkv.attention.metadata import AttentionMetadata, DecodePlan, PrefillChunk
from slimkv.attention.prefill import context_mask
from slimkv.kv.staging import StagedKV


def gqa_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Masked attention for ``q [B, n, Hq, D]`` over ``k, v [B, L, H_kv, D]``, ``mask [B, n, L]``.

    The ``Hq // H_kv`` query heads sharing a KV head are folded into the query axis, so each
    KV head is used as is (no repeat_interleave copy of K/V) in a single SDPA call.
    """
    batch, n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_heads // num_kv_heads
    q = q.view(batch, n, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, group * n, head_dim)  # [B, H_kv, G * n, D]
    mask = mask.unsqueeze(1).expand(batch, group, n, -1).reshape(batch, 1, group * n, -1)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, scale=scale)
    out = out.view(batch, num_kv_heads, group, n, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, n, num_heads, head_dim)


class SdpaBackend(AttentionBackend):
    decode_path, prefill_path = "fast_decode", "fast_prefill"

    @property
    def piece_dtype(self):
        return self.dtype

    def decode(self, layer: int, q: Tensor, plan: DecodePlan, out: Tensor) -> None:
        """All single-token queries at once; the key-padding mask comes from seq_lens. A
        staged cache's last blocks come from the staging slots."""
        k, v = (self.staging or self.cache).read_prefix(layer, plan.block_tables, plan.max_len,
                                                         self.dtype)  # block 0 a float sink
        if self.staging is not None:
            self.staging.overlay(layer, k, v, plan.staging_slots, plan.last_block)
        mask = context_mask(plan.seq_lens, 1, k.shape[1])
        out[plan.rows] = gqa_sdpa(q[plan.rows].unsqueeze(1), k, v, mask, self.scale).squeeze(1)

    def prefill(self, layer: int, q: Tensor, chunk: PrefillChunk, staged: StagedKV | None,
                meta: AttentionMetadata) -> Tensor:
        """The chunk in the pieces the step's metadata planned, over a dequantized copy of
        its pool blocks (planned here only for a step built otherwise: tests)."""
        k, v = (self.staging or self.cache).read_prefix(
            layer, meta.block_tables[chunk.seq:chunk.seq + 1], chunk.seq_len, self.dtype)
        return prefill.run(self.pieces(q, chunk, staged, meta), q, k[0], v[0], staged,
                           self.scale)

    def pieces(self, q: Tensor, chunk: PrefillChunk, staged: StagedKV | None,
               meta: AttentionMetadata) -> tuple[prefill.Piece, ...]:
        """The chunk's pieces: the metadata's, or planned here where the step was built for
        another dtype or staging (tests)."""
        staged_start = None if staged is None else staged.start
        if meta.piece_dtype == self.dtype and chunk.staged_start == staged_start:
            return chunk.pieces
        return tuple(prefill.plan(chunk.seq_len, len(q), staged_start, self.cache.block_size,
                                  self.dtype, q.device))
