"""Weights in a 4-bit or 8-bit class: groups of 32 along K with ``w = d * q + m``.

This is llama.cpp's Q4_1 exactly (Q4_0 is ``m = -8d``, Q8_0 is 8-bit codes with
``m = -128d``), so a GGUF's blocks are adopted as they are, without a round trip through
float; float weights are quantized min/max per group (both at load time, outside the core:
:mod:`slimkv.model_io.convert`). Matmuls run in
:mod:`slimkv.kernels.qgemm` (int8 activations per group of 32, VNNI dot products, or
AVX2's vpmaddubsw).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from slimkv.kernels.qgemm import (PLAIN, PRECISE, ROW_DTYPES, QGemm, pack, qgemm_kernel,
                                  unpack_rows)
from slimkv.kernels.tile_gemm import tile_gemm_kernel
from slimkv.model.gemm import linear

GROUP = 32


@dataclass(slots=True)
class QuantTensor:
    """``[N, K]`` weights: codes ``q`` uint8 ``[N, K * bits / 8]`` (4-bit: byte i of a group
    holds elements i and i + 16, ggml's order), ``d``, ``m`` float16 ``[N, K / 32]``."""

    q: Tensor
    d: Tensor
    m: Tensor
    bits: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.d.shape[1] * GROUP

    def codes(self, rows: Tensor | slice = slice(None)) -> Tensor:
        """Unpacked codes ``[n, K]`` uint8 of the selected rows."""
        q = self.q[rows]
        if self.bits == 8:
            return q
        g = q.view(q.shape[0], -1, GROUP // 2)
        return torch.cat((g & 15, g >> 4), dim=-1).view(q.shape[0], -1)

    def dequantize(self, rows: Tensor | slice = slice(None)) -> Tensor:
        """float32 ``[n, K]`` of the selected rows."""
        q = self.codes(rows).float().view(-1, self.d.shape[1], GROUP)
        w = q * self.d[rows].float()[..., None] + self.m[rows].float()[..., None]
        return w.view(q.shape[0], -1)



def _kernel() -> QGemm:
    kernel = qgemm_kernel()
    if kernel is None:  # the runner only picks a quantized class where the kernel exists
        raise RuntimeError("quantized weights need slimkv/kernels/qgemm.c, which is not built")
    return kernel


class QuantLinear(nn.Module):
    """``nn.Linear`` over a :class:`QuantTensor` (and an optional float bias).

    Up to ``kernel_rows`` activation rows (decode steps, batched decode) go through the int8
    dot-product kernel, which reads only the packed bytes; more rows (prefill) are a float
    GEMM in ``dtype`` over the weights dequantized for the call, where the GEMM's compute,
    not the weight bytes, is what costs."""

    # Measured crossover under the CPU lock (Sapphire Rapids, 2 threads, one step of
    # SmolLM2-135M's 120 projections + the int8 head; scripts/bench_qgemm_step.py, repacked
    # layout): kernel 6 / 12 / 20 / 42 / 61-85 / 128 ms at 1 / 8 / 16 / 32 / 64 / 96 rows,
    # dequantize + bf16 GEMM 115-130 ms from 24 to 96 rows: the kernel up to 64 rows.
    kernel_rows = 64
    # PRECISE activations (int8 + int8 residual) in the kernel: perplexity +0.002% instead of
    # +0.6% vs float activations. Repacked kernel, one step's matmuls at 1 / 8 / 16 rows
    # (under the lock, not fully quiet): int8 5.0-5.7 / 12-14 / 18-22 ms, PRECISE 6.2-6.5 /
    # 22-25 / 36-44 ms, float activations (exact; a FLOAT mode, removed as slower everywhere)
    # 9.1-9.7 / 35-38 / 58-67 ms; engine single stream 9.9-10.6 vs 10.2 ms/step, parallel8
    # 20.8 vs 30.9 ms/step: off by default (it costs batched throughput), the accuracy/speed
    # trade is the caller's.
    precise = False

    def __init__(self, weight: QuantTensor, dtype: torch.dtype, bias: Tensor | None = None) -> None:
        super().__init__()
        self.bits = weight.bits
        self.dtype = dtype
        self.out_features, self.in_features = weight.shape
        # The kernel's layout (output rows interleaved in tiles of 16), made once here.
        self.register_buffer("packed", pack(weight.q, weight.d, weight.m, weight.bits))
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self.kernel = _kernel()
        # The GEMM path in bf16 on AMX tiles, W dequantized on the fly: the same sums as
        # torch's bf16 GEMM over the dequantized W (tests/test_tile_gemm.py), none written.
        self.tiles = tile_gemm_kernel() if dtype == torch.bfloat16 else None

    @property
    def weight(self) -> QuantTensor:
        return self.weight_rows(torch.arange(self.out_features))

    def weight_rows(self, rows: Tensor) -> QuantTensor:
        """The selected rows (int64 indices) in :class:`QuantTensor`'s layout."""
        return QuantTensor(*unpack_rows(self.packed, rows), self.bits)

    def fused(self, x: Tensor, mode: int = PLAIN, norm: nn.Module | None = None,
              out: Tensor | None = None, keep: bool = False) -> Tensor:
        """float32 ``f(x) . W^T (+ bias)``, added into ``out`` when given (see QGemm).
        ``keep``: the GEMM path's result (no bias, no ``out``) stays in ``dtype``, for a
        consumer that reads that dtype (RoPE, a SiLU-mul input) without a float32 copy."""
        if x.shape[0] > self.kernel_rows:
            y = self._gemm(self._prepare(x, mode, norm), out)
            if out is None and (not keep or self.bias is not None or
                                self.dtype not in ROW_DTYPES):
                y = y.float()
        else:
            weight = None if norm is None else _float32(norm.weight)
            y = self.kernel(_float32(x), self.packed, self.out_features,
                            mode=mode | PRECISE if self.precise else mode, norm_weight=weight,
                            eps=0.0 if norm is None else norm.eps, out=out)
        if self.bias is not None:
            y += self.bias
        return y

    def _gemm(self, a: Tensor, out: Tensor | None) -> Tensor:
        """``a . W^T`` in ``dtype``, or added into float32 ``out`` (y's exact values in
        ``dtype``) and ``out`` returned."""
        if self.tiles is not None and a.dtype == torch.bfloat16:
            return self.tiles(a, self.packed, self.out_features, out=out)
        y = linear(a, self.kernel.dequantize(self.packed, self.out_features, self.dtype))
        return y if out is None else self.kernel.add_into(out, y)

    def _prepare(self, x: Tensor, mode: int, norm: nn.Module | None) -> Tensor:
        """The GEMM path's input: what the kernel's input ``mode`` does to ``x``, rounded
        once to ``dtype`` (:meth:`QGemm.prep`); a plain ``x`` already in ``dtype`` as it is."""
        if mode == PLAIN and x.dtype == self.dtype:
            return x
        weight = None if norm is None else _float32(norm.weight)
        return self.kernel.prep(x, mode, weight, 0.0 if norm is None else norm.eps, self.dtype)

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        return self.fused(x.reshape(-1, shape[-1])).view(*shape[:-1], -1).to(x.dtype)


def _float32(t: Tensor) -> Tensor:
    """``t`` itself when it is float32 already (``.float()`` costs ~0.4 us a call)."""
    return t if t.dtype == torch.float32 else t.float()


class QuantEmbedding(nn.Module):
    """An embedding table in a quantized class: looked-up rows are dequantized."""

    def __init__(self, weight: QuantTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = QuantLinear(weight, dtype)  # also the tied LM head

    def forward(self, ids: Tensor) -> Tensor:
        """float32 rows (the residual stream of a quantized model is float32)."""
        return self.table.weight_rows(ids).dequantize()
