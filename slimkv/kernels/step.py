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
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from slimkv.kernels import SOURCE as DECODE_SOURCE
from slimkv.kernels import build, qgemm, stage
from slimkv.kernels.qgemm import PRECISE, RMSNORM, SILU_MUL
from slimkv.model.lean import QuantBlock

SOURCE = Path(__file__).with_name("decode_step.c")
ptr, i32 = ctypes.c_void_p, ctypes.c_int32


class Linear(ctypes.Structure):
    _fields_ = [("w", ptr), ("bias", ptr), ("bits", i32), ("n", i32), ("mode", i32)]


class Layer(ctypes.Structure):
    _fields_ = [("qkv", Linear), ("o", Linear), ("gate_up", Linear), ("down", Linear),
                ("attn_norm", ptr), ("ffn_norm", ptr), ("attn_eps", ctypes.c_float),
                ("ffn_eps", ctypes.c_float), ("stage_k", ptr), ("stage_v", ptr),
                ("k_side", ptr), ("v_side", ptr)]


class Step(ctypes.Structure):
    _fields_ = [*((name, ptr) for name in ("qgemm", "rope", "stage", "decode", "round_to")),
                *((name, i32) for name in ("T", "hidden", "hq", "hkv", "head_dim", "dtype_kind",
                                           "stage_kind", "block_size", "max_blocks")),
                ("scale", ctypes.c_float),
                *((name, ptr) for name in ("cos", "sin", "positions", "slots", "offsets",
                                           "block_tables", "seq_lens", "qkv", "q", "attn",
                                           "gate_up"))]


def _functions() -> tuple[dict[str, int], Any] | None:
    """Addresses of the kernels the step calls and ``decode_step`` itself, or None where a
    library cannot be had."""
    libs = [build.load(s) for s in (qgemm.SOURCE, stage.SOURCE, DECODE_SOURCE, SOURCE)]
    if any(isinstance(lib, str) for lib in libs):
        return None
    q, st, dec, lib = libs
    fns = dict(qgemm=q.qgemm, rope=q.rope_inplace, stage=st.stage_decode, decode=dec.paged_decode,
               round_to=st.round_rows)
    call = lib.decode_step
    call.argtypes, call.restype = [ptr, ptr, ctypes.c_int, ptr], None
    return {name: ctypes.cast(fn, ptr).value for name, fn in fns.items()}, call


def _linear(lin: Any, mode: int) -> Linear:
    bias = None if lin.bias is None else lin.bias.data_ptr()
    return Linear(lin.packed.data_ptr(), bias, (lin.packed.shape[2] >> 6) - 1, lin.out_features,
                  mode | PRECISE if lin.precise else mode)


class LeanStep:
    """All layers of a decode step in one call where it can run; see the module doc.

    ``attention`` is the model's :class:`~slimkv.attention.PagedAttention` (its
    ``can_lean``, ``lean_layer`` and ``after_lean_step``); ``enabled`` = False keeps the
    per-op path (tests compare the two)."""

    def __init__(self, model: torch.nn.Module, attention: Any) -> None:
        self.model, self.attention, self.enabled = model, attention, True
        blocks = list(getattr(model, "layers", []))
        lean = (blocks and all(isinstance(b, QuantBlock) for b in blocks) and
                model.rope_cos.dtype == torch.float32 and attention.staging is not None and
                attention.cache.device.type == "cpu")
        self._fns, self._call = (_functions() or (None, None)) if lean else (None, None)
        self._blocks = blocks if self._fns else []
        self._linears = [lin for b in self._blocks for lin in b.parts[:4]]
        self._keep: list = []  # what the layer table points into
        self._precise: tuple[bool, ...] | None = None
        self._layers: ctypes.Array | None = None
        self._buffers: list[Tensor] = []

    @property
    def available(self) -> bool:
        return self._fns is not None

    def bind(self, meta: Any) -> Callable[[Tensor, Tensor], None] | None:
        """The step's layers as one call ``(x, positions)`` for ``meta``, or None when the
        per-op path must run them."""
        plan = meta.decode
        if not (self.enabled and self._fns and self.attention.can_lean(plan) and
                len(plan.seq_lens) <= self._linears[0].kernel_rows):
            return None
        return lambda x, positions: self._run(x, positions, plan)

    def _run(self, x: Tensor, positions: Tensor, plan: Any) -> None:
        precise = tuple(lin.precise for lin in self._linears)
        if precise != self._precise:
            self._layers, self._precise = self._layer_table(), precise
        step = self._step(x.shape[0], positions, plan)
        self._call(ctypes.byref(step), self._layers, len(self._blocks), x.data_ptr())
        self.attention.after_lean_step(plan, len(self._blocks))

    def _layer_table(self) -> ctypes.Array:
        self._keep = []
        table = (Layer * len(self._blocks))()
        for i, block in enumerate(self._blocks):
            wqkv, wo, w13, w2, attn_norm, ffn_norm, layer = block.parts[:7]
            stage_k, stage_v, k_side, v_side = self.attention.lean_layer(layer)
            table[i] = Layer(_linear(wqkv, RMSNORM), _linear(wo, 0), _linear(w13, RMSNORM),
                             _linear(w2, SILU_MUL), attn_norm.weight.data_ptr(),
                             ffn_norm.weight.data_ptr(), attn_norm.eps, ffn_norm.eps,
                             stage_k.data_ptr(), stage_v.data_ptr(), ctypes.addressof(k_side),
                             ctypes.addressof(v_side))
            self._keep.append((block.parts, k_side, v_side))
        return table

    def _step(self, rows: int, positions: Tensor, plan: Any) -> Step:
        wqkv, _, w13, _, _, _, _, head_dim, hq, hqk = self._blocks[0].parts
        if not self._buffers or self._buffers[0].shape[0] != rows:
            self._buffers = [torch.empty(rows, n, dtype=torch.float32) for n in
                             (wqkv.out_features, hq * head_dim, hq * head_dim, w13.out_features)]
        a, model, stage_k = self.attention, self.model, self.attention.staging.buffer
        cos, sin = model.rope_cos, model.rope_sin
        return Step(**self._fns, T=rows, hidden=wqkv.in_features, hq=hq, hkv=hqk - hq,
                    head_dim=head_dim, dtype_kind=stage.KINDS[a.dtype],
                    stage_kind=stage.KINDS[stage_k.dtype], block_size=a.cache.block_size,
                    max_blocks=plan.block_tables.shape[1], scale=a.scale, cos=cos.data_ptr(),
                    sin=sin.data_ptr(), positions=positions.data_ptr(),
                    slots=plan.staging_slots.data_ptr(), offsets=plan.offsets.data_ptr(),
                    block_tables=plan.block_tables.data_ptr(),
                    seq_lens=plan.seq_lens.data_ptr(),
                    **{name: b.data_ptr() for name, b in
                       zip(("qkv", "q", "attn", "gate_up"), self._buffers)})
