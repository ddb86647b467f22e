"""The CPU backend: decodes through the fused C kernel of :mod:`slimkv.kernels` (gather,
dequantize and attend without a float copy of the cache: ``fused_decode``), prefill chunks
as the torch backend's SDPA pieces (``fast_prefill``, a bf16 chunk in slimkv's own prefill
kernel where the CPU has AVX512-BF16).

A step of decodes only over a staged cache takes the *lean* decode in each layer: one C
call stages K/V and rounds Q (:mod:`slimkv.backends.cpu_stage`), full blocks go to the pool,
then the kernel attends. The one-call step (:mod:`slimkv.backends.cpu_step`) runs the same
for every layer at once (:meth:`CpuBackend.can_lean`, :meth:`lean_layer`,
:meth:`after_lean_step`), also for an unstaged pool stored in the model dtype, which the
stage kernel writes as it writes staging.

An int8 pool's blocks go in through :mod:`slimkv.backends.cpu_kv`'s kernel (the pool's
writer quantizes whole blocks). A staged bf16 chunk (int8, int4, fp8 keys) attends in one
call of the prefill kernel for all its pieces (:mod:`slimkv.backends.cpu_prefill`), which
reads an int8 pool's codes itself. Elsewhere a chunk reads its int8 prefix dequantized
straight into the model dtype (``cpu_kv``) and attends piece by piece, each piece's staged
keys copied in after its pool keys (pieces last to first, each overwriting only keys the
earlier ones do not see) instead of concatenated with them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor

from slimkv.attention import prefill
from slimkv.attention.metadata import AttentionMetadata, DecodePlan, PrefillChunk
from slimkv.attention.sdpa import SdpaBackend
from slimkv.backends import cpu_prefill
from slimkv.backends.cpu_kv import KINDS as KV_KINDS
from slimkv.backends.cpu_kv import CpuPoolWriter, int8_mode, kv_blocks_kernel
from slimkv.backends.cpu_stage import KINDS, stage_kernel
from slimkv.backends.cpu_step import LeanStep, hadamard_kernel
from slimkv.backends.cpu_decode import KVSide, decode_kernel, describe, kernel_unavailable_reason
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.quant import FloatCodec
from slimkv.kv.staging import StagedKV
from slimkv.stats import cdiv


class CpuBackend(SdpaBackend):
    decode_path = "fused_decode"
    # A staged bf16 chunk's pieces in one kernel call (cpu_prefill); False: piece by piece,
    # as before issue 47 (tests compare the two).
    one_call_prefill = True
    # That call reads an int8 pool's codes and scales itself (cpu_prefill.one_call_int8);
    # False: through a dequantized bf16 copy of the prefix, as before (benchmarks compare).
    read_codes = True

    @staticmethod
    def unavailable(cache: PagedKVCache) -> str | None:
        if cache.device.type != "cpu":
            return f"the fused C decode kernel is CPU-only (device {cache.device})"
        return kernel_unavailable_reason()

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        cache, staging, dtype = self.cache, self.staging, self.dtype
        self.kernel = decode_kernel()
        self.sides: list[tuple[KVSide, KVSide]] = [
            tuple(describe(cache.layer_codecs[layer][side], cache.layer_pool(side, layer))
                  for side in ("k", "v")) for layer in range(cache.num_layers)]
        if staging is not None and staging.num_sink:  # ids the kernel reads at float
            for side in (s for pair in self.sides for s in pair):
                side.sink_from, side.sink_shift = staging.sink_from, staging.sink_shift
        lean = dtype in KINDS and (
            staging.buffer.dtype == dtype if staging is not None else
            all(isinstance(c, FloatCodec) and c.storage_dtype == dtype for c in cache.all_codecs()))
        self.stage = stage_kernel() if lean else None
        self._q = torch.empty(0)  # one float32 Q buffer, reused by every layer's lean decode
        self.modes = [tuple(int8_mode(cache.layer_codecs[layer][side]) for side in ("k", "v"))
                      for layer in range(cache.num_layers)]
        int8 = any(None not in modes for modes in self.modes) and dtype in KV_KINDS
        self.blocks = kv_blocks_kernel() if int8 else None
        if self.blocks is not None and cache.block_scaled and cache.writer is None:
            cache.writer = CpuPoolWriter(cache, self.blocks)

    @functools.cached_property
    def _hadamard(self) -> Callable[[Tensor], Tensor] | None:
        return hadamard_kernel()  # built on first use: only kv_cache.int4's rotations call it

    def rotate(self, x: Tensor) -> Tensor:
        """In C (decode_step.c's ``hadamard_rows``): the one-call step's very sums."""
        if type(x) is not torch.Tensor or self._hadamard is None:
            return super().rotate(x)
        return self._hadamard(x).to(x.dtype)

    def forward(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                meta: AttentionMetadata) -> tuple[Tensor, tuple[str, ...]]:
        if self.staging is not None and self.can_lean(meta.decode):
            return self._lean_decode(layer, q, k, v, meta.decode), (self.decode_path,)
        return super().forward(layer, q, k, v, meta)

    def decode(self, layer: int, q: Tensor, plan: DecodePlan, out: Tensor) -> None:
        buffers = None if self.staging is None else self.staging.layer_buffers(layer)
        out[plan.rows] = self.kernel(
            q[plan.rows].float(), plan.block_tables, plan.seq_lens, *self.sides[layer],
            self.cache.num_kv_heads, self.cache.block_size, self.scale,
            None if buffers is None else (*buffers, plan.staging_slots)).to(self.dtype)

    def prefill(self, layer: int, q: Tensor, chunk: PrefillChunk, staged: StagedKV | None,
                meta: AttentionMetadata) -> Tensor:
        modes = self.modes[layer]
        int8 = self.blocks is not None and None not in modes
        one_call = self.one_call_prefill and staged is not None and q.dtype == torch.bfloat16
        if type(q) is not torch.Tensor or not (int8 or one_call):
            return super().prefill(layer, q, chunk, staged, meta)
        pieces = self.pieces(q, chunk, staged, meta)
        if not int8:  # SdpaBackend.prefill's keys and pieces
            k, v = (x[0] for x in (self.staging or self.cache).read_prefix(
                layer, meta.block_tables[chunk.seq:chunk.seq + 1], chunk.seq_len, self.dtype))
            out = cpu_prefill.one_call(q, k, v, staged, pieces, chunk.start,
                                       self.cache.block_size, self.scale)
            return prefill.run(pieces, q, k, v, staged, self.scale) if out is None else out
        bs, pool = self.cache.block_size, max(p.num_pool_keys for p in pieces)
        ids = meta.block_tables[chunk.seq, :cdiv(pool, bs)]
        sides = tuple(self.cache.layer_pool(side, layer) for side in ("k", "v"))
        sink = self.staging is not None and self.staging.num_sink and len(ids) and \
            bool(ids[0] >= self.staging.sink_from)  # block 0 at float (a sink id)
        if one_call and self.read_codes and not sink:  # no dequantized copy of the prefix
            out = cpu_prefill.one_call_int8(q, *sides, modes, ids, staged, pieces, chunk.start,
                                            bs, self.scale)
            if out is not None:
                return out
        rows = max(p.num_pool_keys + (p.staged.stop - p.staged.start if p.staged else 0)
                   for p in pieces)  # the copy's rows: pool keys, then staged ones
        k, v = (self.blocks.read(side, mode, ids, self.dtype, rows)
                for side, mode in zip(sides, modes))
        if sink:
            row = ids[0] + self.staging.sink_shift
            k[:bs], v[:bs] = self.staging.buffer[:, layer, row].to(self.dtype)
        out = cpu_prefill.one_call(q, k, v, staged, pieces, chunk.start, bs,
                                   self.scale) if one_call else None
        if out is not None:
            return out
        out = torch.empty_like(q)
        for p in reversed(pieces):  # pool keys grow piece by piece
            n = p.num_pool_keys
            if p.staged is not None:
                n += p.staged.stop - p.staged.start
                k[p.num_pool_keys:n], v[p.num_pool_keys:n] = staged.k[p.staged], staged.v[p.staged]
            out[p.rows] = prefill.attend(q[p.rows], k[:n], v[:n], p.mask, self.scale)
        return out

    def _lean_decode(self, layer: int, q: Tensor, k: Tensor, v: Tensor,
                     plan: DecodePlan) -> Tensor:
        take = self.stage.takes
        if not (take(q) and take(k) and take(v)):
            q, k, v = (x if take(x) else x.float().contiguous() for x in (q, k, v))
        if self._q.shape != q.shape:
            self._q = torch.empty(q.shape, dtype=torch.float32)
        stage_k, stage_v = self.staging.layer_buffers(layer)
        slots = plan.staging_slots
        q = self.stage(q, k, v, self.dtype, stage_k, stage_v, slots, plan.offsets, self._q)
        if plan.filled is not None:
            self.staging.store_filled(layer, slots, plan.last_block_id, plan.filled)
        return self.kernel(q, plan.block_tables, plan.seq_lens, *self.sides[layer],
                           self.cache.num_kv_heads, self.cache.block_size, self.scale,
                           (stage_k, stage_v, slots)).to(self.dtype)

    def one_call_step(self, model: torch.nn.Module, attention) -> LeanStep:
        return LeanStep(model, attention)

    def can_lean(self, plan: DecodePlan | None) -> bool:
        """Whether the step (``meta.decode``) is decodes only and takes the lean decode."""
        return plan is not None and plan.whole and self.stage is not None

    def lean_layer(self, layer: int) -> tuple[Tensor, Tensor, KVSide, KVSide]:
        """Where a layer's new K, V go (staging, else the pool) and its pool sides, for the
        one-call decode step."""
        buffers = self.staging.layer_buffers(layer) if self.staging is not None else tuple(
            self.cache.layer_pool(side, layer).data for side in ("k", "v"))
        return (*buffers, *self.sides[layer])

    def after_lean_step(self, plan: DecodePlan) -> None:
        """After that step: filled blocks into the pool (its kernel read them from the
        staging slots)."""
        if self.staging is not None:
            self.staging.store_filled(None, plan.staging_slots, plan.last_block_id,
                                                 plan.filled)
