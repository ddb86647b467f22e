"""The CUDA backend: the Triton kernels of :mod:`slimkv.kernels.triton` read the pool's pages
in place for decodes (``triton_decode``: split-K, GQA heads sharing one read of a KV row)
and for prefill chunks (``triton_prefill``), and the pool's writes go through them too
(:class:`~slimkv.kernels.triton.pool.TritonPoolWriter`, set on the cache when the backend is
built). On the CPU it runs under ``TRITON_INTERPRET=1`` (tests)."""

from __future__ import annotations

from torch import Tensor

from slimkv.attention.backend import AttentionBackend
from slimkv.attention.metadata import AttentionMetadata, DecodePlan, PrefillChunk
from slimkv.kernels.triton import triton_unavailable_reason
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import StagedKV


class TritonBackend(AttentionBackend):
    decode_path, prefill_path = "triton_decode", "triton_prefill"

    @staticmethod
    def unavailable(cache: PagedKVCache) -> str | None:
        return triton_unavailable_reason(cache.device)

    def __init__(self, *args, **kwargs) -> None:
        from slimkv.kernels.triton.decode import TritonDecode
        from slimkv.kernels.triton.pool import TritonPoolWriter
        from slimkv.kernels.triton.prefill import paged_prefill
        from slimkv.kernels.triton.side import describe

        super().__init__(*args, **kwargs)
        cache = self.cache
        cache.writer = TritonPoolWriter(cache)
        self.kernel, self._prefill = TritonDecode(), paged_prefill
        # Where the cache keeps block 0 at float: the ids the kernels read from the staging
        # buffer instead of the pool (docs/kv-formats.md, "The sink block").
        staging = self.staging
        self.sink = (staging.sink_from, staging.sink_shift) if staging and staging.num_sink else None
        self.sides = [tuple(describe(cache.layer_codecs[layer][side], cache.layer_pool(side, layer))
                            for side in ("k", "v")) for layer in range(cache.num_layers)]

    def decode(self, layer: int, q: Tensor, plan: DecodePlan, out: Tensor) -> None:
        staged = None if self.staging is None else (*self.staging.layer_buffers(layer),
                                                    plan.staging_slots)
        out[plan.rows] = self.kernel(q[plan.rows].float(), plan.block_tables, plan.seq_lens,
                                     *self.sides[layer], self.cache.num_kv_heads,
                                     self.cache.block_size, self.scale, staged,
                                     self.sink).to(self.dtype)

    def prefill(self, layer: int, q: Tensor, chunk: PrefillChunk, staged: StagedKV | None,
                meta: AttentionMetadata) -> Tensor:
        sink = self.sink and (*self.staging.layer_buffers(layer), *self.sink)
        return self._prefill(q, meta.block_tables[chunk.seq], chunk.seq_len, *self.sides[layer],
                             staged, self.scale, sink=sink)
