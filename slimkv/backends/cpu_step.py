"""``decode_step.c`` through ctypes: every layer of a decode step in one call.

A step of single-token decodes over a quantized model (:class:`~slimkv.model.lean.QuantBlock`
layers) and a staged KV cache otherwise costs ~10 ctypes calls and a few torch ops per
layer; :class:`LeanStep` runs the same kernels, in the same order, from one C loop, with
per-step buffers kept between steps. Its results are bit-identical to the per-op path,
which still runs whatever it cannot take (prefill chunks, more rows than the weight
kernel's, a model or cache outside the lean path, a kernel that cannot be built).
"""

from __future__ import annotations

import ctypes
import operator
from typing import Any, Callable

import torch
from torch import Tensor

from slimkv.backends.cpu_decode import SOURCE as DECODE_SOURCE
from slimkv.backends import cpu_stage as stage
from slimkv.kernels import build, qgemm
from slimkv.kernels.qgemm import PRECISE, RMSNORM, SILU_MUL
from slimkv.model.lean import QuantBlock
from slimkv.model.quant import QuantEmbedding

SOURCE = DECODE_SOURCE.with_name("decode_step.c")
ptr, i32 = ctypes.c_void_p, ctypes.c_int32
_PRECISE = operator.attrgetter("precise")


class Linear(ctypes.Structure):
    _fields_ = [("w", ptr), ("bias", ptr), ("bits", i32), ("n", i32), ("mode", i32)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("attn_norm", ptr), ("ffn_norm", ptr), ("attn_eps", ctypes.c_float),
                ("ffn_eps", ctypes.c_float), ("stage_k", ptr), ("stage_v", ptr),
                ("k_side", ptr), ("v_side", ptr), ("rotate", i32),
                ("rotate_scale", ctypes.c_float)]


class Step(ctypes.Structure):
    _fields_ = [*((name, ptr) for name in ("qgemm", "rope", "stage", "decode", "round_to",
                                           "dequant", "embed")),
                ("embed_tile_bytes", ctypes.c_int64),
                *((name, i32) for name in ("embed_bits", "T", "hidden", "hq", "hkv", "head_dim",
                                           "dtype_kind", "stage_kind", "block_size",
                                           "max_blocks")),
                ("scale", ctypes.c_float),
                *((name, ptr) for name in ("cos", "sin", "positions", "slots", "offsets",
                                           "own_slots", "block_tables", "seq_lens", "ids", "qkv", "q", "attn",
                                           "gate_up", "tile"))]


def _functions() -> tuple[dict[str, int], Any] | None:
    """Addresses of the kernels the step calls and ``decode_step`` itself, or None where a
    library cannot be had."""
    libs = [build.load(s) for s in (qgemm.SOURCE, stage.SOURCE, DECODE_SOURCE, SOURCE)]
    if any(isinstance(lib, str) for lib in libs):
        return None
    q, st, dec, lib = libs
    fns = dict(qgemm=q.qgemm, rope=q.rope_inplace, stage=st.stage_decode, decode=dec.paged_decode,
               round_to=st.round_rows, dequant=q.qdequant)
    call = build.signature(lib.decode_step, [ptr, ptr, ctypes.c_int, ptr])
    return {name: ctypes.cast(fn, ptr).value for name, fn in fns.items()}, call


def hadamard_kernel() -> Callable[[Tensor], Tensor] | None:
    """``hadamard_rows`` of decode_step.c as ``f(x)``: a float32 copy of ``x [T, heads, D]``
    rotated (:meth:`slimkv.attention.backend.AttentionBackend.rotate`), or None where the
    library cannot be built."""
    lib = build.load(SOURCE)
    if isinstance(lib, str):
        return None
    fn = build.signature(lib.hadamard_rows, [ptr, ctypes.c_int, ctypes.c_int64, ctypes.c_int,
                                             ctypes.c_int, ctypes.c_float])

    def rotate(x: Tensor) -> Tensor:
        y = x.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        rows, heads, dim = y.shape  # [T, heads, D]
        fn(y.data_ptr(), rows, heads * dim, heads, dim, dim ** -0.5)
        return y
    return rotate


def _linear(lin: Any, mode: int) -> Linear:
    bias = None if lin.bias is None else lin.bias.data_ptr()
    return Linear(lin.packed.data_ptr(), bias, (lin.packed.shape[2] >> 6) - 1, lin.out_features,
                  mode | PRECISE if lin.precise else mode)


class LeanStep:
    """The embedding and all layers of a decode step in one call where it can run; see the
    module doc.

    ``attention`` is the model's :class:`~slimkv.attention.layer.PagedAttention` (its
    ``after_lean_step``; its :class:`~slimkv.backends.cpu.CpuBackend`'s ``can_lean`` and
    ``lean_layer``); ``enabled`` = False keeps the
    per-op path (tests compare the two)."""

    def __init__(self, model: torch.nn.Module, attention: Any) -> None:
        self.model, self.attention, self.enabled = model, attention, True
        blocks = list(getattr(model, "layers", []))
        lean = (blocks and all(isinstance(b, QuantBlock) for b in blocks) and
                model.rope_cos.dtype == torch.float32 and attention.cache.device.type == "cpu")
        self._fns, self._call = (_functions() or (None, None)) if lean else (None, None)
        self._blocks = blocks if self._fns else []
        self._linears = [lin for b in self._blocks for lin in b.parts[:4]]
        self._keep: list = []  # what the layer table points into
        self._precise: tuple[bool, ...] | None = None
        self._layers: ctypes.Array | None = None
        self._step: Step | None = None
        self._buffers: list[Tensor] = []

    def reset(self) -> None:
        """Forget the layer table (made again on the next step): after a change of the
        model's weights or biases. ``set_activations`` is noticed without this."""
        self._precise = None

    @property
    def available(self) -> bool:
        return self._fns is not None

    def bind(self, meta: Any) -> Callable[[Tensor, Tensor], Tensor] | None:
        """The step's embedding and layers as one call ``(input_ids, positions) -> x``
        (the residual after the last layer) for ``meta``, or None when the per-op path
        must run them."""
        plan = meta.decode
        if not (self.enabled and self._fns and self.attention.backend.can_lean(plan) and
                len(plan.seq_lens) <= self._linears[0].kernel_rows):
            return None
        return lambda ids, positions: self._run(ids, positions, plan)

    def _run(self, ids: Tensor, positions: Tensor, plan: Any) -> Tensor:
        precise = tuple(map(_PRECISE, self._linears))
        if precise != self._precise:
            self._layers, self._precise = self._layer_table(), precise
        step, x = self._step_for(ids, positions, plan)
        self._call(ctypes.byref(step), self._layers, len(self._blocks), x.data_ptr())
        self.attention.after_lean_step(plan)
        return x

    def _layer_table(self) -> ctypes.Array:
        self._keep = []
        table = (Layer * len(self._blocks))()
        for i, block in enumerate(self._blocks):
            wqkv, wo, w13, w2, attn_norm, ffn_norm, layer = block.parts[:7]
            stage_k, stage_v, k_side, v_side = self.attention.backend.lean_layer(layer)
            rotate_k, rotate_v = self.attention.rotate[layer]
            table[i] = Layer(_linear(wqkv, RMSNORM), _linear(wo, 0), _linear(w13, RMSNORM),
                             _linear(w2, SILU_MUL), attn_norm.weight.data_ptr(),
                             ffn_norm.weight.data_ptr(), attn_norm.eps, ffn_norm.eps,
                             stage_k.data_ptr(), stage_v.data_ptr(), ctypes.addressof(k_side),
                             ctypes.addressof(v_side), rotate_k | rotate_v << 1,
                             block.parts[7] ** -0.5)
            self._keep.append((block.parts, stage_k, stage_v, k_side, v_side))
        return table

    def _step_for(self, ids: Tensor, positions: Tensor, plan: Any) -> tuple[Step, Tensor]:
        """The call's arguments (made once per batch size, then this step's metadata)
        and the residual it fills: the embeddings, or the model's when its table is not
        quantized."""
        rows = len(ids)
        if self._step is None or self._step.T != rows:
            self._step = self._new_step(rows)
        step, x = self._step, self._buffers[0]
        embed = self.model.tok_embeddings
        if not isinstance(embed, QuantEmbedding):
            x.copy_(embed(ids))
        step.max_blocks = plan.block_tables.shape[1]
        step.positions, step.ids = positions.data_ptr(), ids.data_ptr()
        own = plan.staging_slots  # a staged cache; else the new K/V go to the pool's blocks
        step.slots = (plan.last_block_id if own is None else own).data_ptr()
        step.own_slots = None if own is None else own.data_ptr()
        step.offsets = plan.offsets.data_ptr()
        step.block_tables, step.seq_lens = plan.block_tables.data_ptr(), plan.seq_lens.data_ptr()
        return step, x

    def _new_step(self, rows: int) -> Step:
        wqkv, _, w13, _, _, _, _, head_dim, hq, hqk = self._blocks[0].parts
        hidden = wqkv.in_features
        self._buffers = [torch.empty(rows, n, dtype=torch.float32) for n in
                         (hidden, wqkv.out_features, hq * head_dim, hq * head_dim,
                          w13.out_features)] + [torch.empty(16, hidden)]
        a, model = self.attention, self.model
        table = getattr(model.tok_embeddings, "table", None)
        embed = table.packed if isinstance(model.tok_embeddings, QuantEmbedding) else None
        return Step(**self._fns, embed=None if embed is None else embed.data_ptr(),
                    embed_tile_bytes=0 if embed is None else embed.stride(0),
                    embed_bits=0 if embed is None else table.bits, T=rows, hidden=hidden,
                    hq=hq, hkv=hqk - hq, head_dim=head_dim, dtype_kind=stage.KINDS[a.dtype],
                    stage_kind=stage.KINDS[a.dtype],  # staging's or the pool's (same)
                    block_size=a.cache.block_size, scale=a.scale,
                    cos=model.rope_cos.data_ptr(), sin=model.rope_sin.data_ptr(),
                    **{name: b.data_ptr() for name, b in
                       zip(("qkv", "q", "attn", "gate_up", "tile"), self._buffers[1:])})
