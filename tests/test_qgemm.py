"""The weight kernel (slimkv/kernels/qgemm.c) against pure-torch references, and the
group-32 weight formats against the GGUF reader's own dequantization."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slimkv.kernels.qgemm import (PLAIN, PRECISE, RMSNORM, SILU_MUL, pack, qgemm_kernel,
                                  qgemm_unavailable_reason, unpack_rows)
from slimkv.model.quant import QuantLinear, QuantTensor
from slimkv.model_io.convert import cat_rows, from_gguf, quantize, to_bits

pytestmark = pytest.mark.skipif(qgemm_kernel() is None,
                                reason=f"no weight kernel: {qgemm_unavailable_reason()}")
SHAPES = [(64, 576), (50, 96), (7, 32), (300, 1536)]  # odd group counts and N % 4 != 0 too


class Norm(torch.nn.Module):
    def __init__(self, k: int, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(k, generator=gen) + 0.5, requires_grad=False)
        self.eps = 1e-5


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 codes and scales per group of 32, as the kernel's contract states."""
    g = x.double().view(x.shape[0], -1, 32)
    d = (g.abs().amax(-1) / 127).float().double()
    q = torch.where(d[..., None] > 0, g / d[..., None], torch.zeros_like(g)).round()
    return q, d


def exact_reference(x: torch.Tensor, w: QuantTensor) -> torch.Tensor:
    """float64 y = sum over groups of d_w d_a (q . qa) + m_w d_a sum(qa)."""
    qa, da = quantize_activations(x)
    qw = w.codes().double().view(w.shape[0], -1, 32)
    dot = torch.einsum("mgk,ngk->mng", qa, qw)
    scale = w.d.double()[None] * da[:, None]
    return (dot * scale + w.m.double()[None] * (da * qa.sum(-1))[:, None]).sum(-1)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 5, 9])  # 5, 9: tiles of 4 rows and a remainder
def test_kernel_equals_the_integer_reference(bits: int, shape: tuple[int, int], rows: int) -> None:
    n, k = shape
    gen = _gen(n + k + bits)
    w = quantize(torch.randn(n, k, generator=gen), bits)
    x = torch.randn(rows, k, generator=gen) * 3
    y = QuantLinear(w, torch.float32).fused(x)
    ref = exact_reference(x, w)
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    # and within the activation rounding bound of the float matmul over the same weights
    wf = w.dequantize().double()
    _, da = quantize_activations(x)
    bound = (da[:, None, :] / 2 * wf.abs().view(n, -1, 32).sum(-1)[None]).sum(-1)
    assert ((y.double() - x.double() @ wf.T).abs() <= bound * 1.001 + 1e-4).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3])
def test_extreme_codes_and_activations_do_not_saturate(bits: int, rows: int) -> None:
    """Codes at 0 / the top and activations at +-127, where 16-bit pair sums (AVX2's
    vpmaddubsw) would saturate if taken naively: the exact integer sums all the same."""
    gen = _gen(bits + rows)
    n, k, top = 48, 576, (1 << bits) - 1
    codes = torch.randint(0, 2, (n, k), generator=gen, dtype=torch.uint8) * top
    codes[: n // 2] = top  # whole rows at the top code too
    if bits == 4:
        g = codes.view(n, -1, 2, 16)
        codes = (g[:, :, 0] | g[:, :, 1] << 4).view(n, -1)
    d = torch.full((n, k // 32), 2.0 ** -10).half()
    w = QuantTensor(codes, d, torch.zeros_like(d), bits)
    x = torch.randint(0, 2, (rows, k), generator=gen).float() * 2 - 1  # +-1: codes +-127
    x[0] = 1.0
    y, ref = QuantLinear(w, torch.float32).fused(x).double(), exact_reference(x, w)
    # float32 sums of exact group sums (one saturated pair would be off by ~2^-10 * 2^15)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 2, 5])
def test_precise_activations_are_within_the_residual_rounding_bound(bits: int, rows: int) -> None:
    """PRECISE: x = int8 row + int8 residual row; the error against the float64 matmul on
    the same weights is bounded by half a residual step per value (amax / 127 / 254 per
    group at most), 254x below the int8 bound; with RMSNorm and residual add on top."""
    gen, (n, k) = _gen(rows + bits), (70, 576)
    w = quantize(torch.randn(n, k, generator=gen), bits)
    x = torch.randn(rows, k, generator=gen) * 3
    x[:, 5] = 40  # an outlier in group 0
    kernel, wf, packed = qgemm_kernel(), w.dequantize().double(), pack(w.q, w.d, w.m, bits)
    y = kernel(x, packed, n, mode=PLAIN | PRECISE)
    ref = x.double() @ wf.T
    _, da = quantize_activations(x)
    bound = (da[:, None, :] / 254 / 2 * wf.abs().view(n, -1, 32).sum(-1)[None]).sum(-1)
    assert ((y.double() - ref).abs() <= bound * 1.01 + 1e-5 * ref.abs().max()).all()
    assert (y.double() - ref).abs().max() < (kernel(x, packed, n).double() - ref).abs().max()
    norm, residual = Norm(k, gen), torch.randn(rows, n, generator=gen)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    out = kernel(x, packed, n, mode=RMSNORM | PRECISE, norm_weight=norm.weight,
                 eps=norm.eps, out=residual.clone())
    ref = normed.double() @ wf.T
    torch.testing.assert_close(out.double(), residual.double() + ref, rtol=1e-4,
                               atol=1e-4 * float(ref.abs().max()))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 9, QuantLinear.kernel_rows + 1])
def test_fused_input_modes_and_residual_add(bits: int, rows: int) -> None:
    """RMSNorm / SiLU-mul on the way in, add into ``out``: the kernel (rows <=
    ``kernel_rows``) and the GEMM path (more rows) both equal torch ops on the dequantized
    weights."""
    gen, k, n = _gen(rows + bits), 96, 40
    w = quantize(torch.randn(n, k, generator=gen), bits)
    lin, norm, wf = QuantLinear(w, torch.float32), Norm(k, gen), w.dequantize()
    x = torch.randn(rows, k, generator=gen)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    gate_up = torch.randn(rows, 2 * k, generator=gen)
    silu = torch.nn.functional.silu(gate_up[:, :k]) * gate_up[:, k:]
    residual = torch.randn(rows, n, generator=gen)
    out = residual.clone()
    lin.fused(gate_up, SILU_MUL, out=out)
    tol = dict(rtol=0.02, atol=0.02 * float((silu @ wf.T).abs().max()))
    torch.testing.assert_close(out, residual + silu @ wf.T, **tol)
    torch.testing.assert_close(lin.fused(x, RMSNORM, norm), normed @ wf.T,
                               rtol=0.02, atol=0.02 * float((normed @ wf.T).abs().max()))
    torch.testing.assert_close(lin.fused(x, PLAIN), x @ wf.T,
                               rtol=0.02, atol=0.02 * float((x @ wf.T).abs().max()))


@pytest.mark.parametrize("bits", [4, 8])
def test_quantize_round_trip_and_c_dequantize(bits: int) -> None:
    gen = _gen(bits)
    x = torch.randn(33, 576, generator=gen)
    w = quantize(x, bits)
    err = (w.dequantize() - x).abs().view(33, -1, 32)
    assert (err <= w.d.float()[..., None] / 2 * 1.01 + 1e-3).all()
    packed = pack(w.q, w.d, w.m, bits)
    c = qgemm_kernel().dequantize(packed, 33, torch.float32)
    assert torch.equal(c, w.dequantize())
    c16 = qgemm_kernel().dequantize(packed, 33, torch.bfloat16)
    assert torch.equal(c16, w.dequantize().bfloat16())


def test_four_bits_widen_to_eight_exactly_and_mixed_rows_meet_at_eight() -> None:
    gen = _gen(0)
    w4, w8 = quantize(torch.randn(8, 64, generator=gen), 4), quantize(torch.randn(4, 64), 8)
    assert torch.equal(to_bits(w4, 8).dequantize(), w4.dequantize())
    both = cat_rows([w4, w8])
    assert both.bits == 8 and torch.equal(both.dequantize(),
                                          torch.cat([w4.dequantize(), w8.dequantize()]))


def test_gguf_blocks_are_adopted_exactly() -> None:
    """Q4_1 and Q8_0 tensors of the embedded GGUF, and Q4_0 blocks made by gguf's own
    quantizer: our dequantization equals gguf's."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize, quantize as gguf_quantize

    from slimkv.model_io.loader import default_model_path
    reader = gguf.GGUFReader(default_model_path())
    seen = set()
    for t in reader.tensors:
        name = t.tensor_type.name
        if name in ("Q4_1", "Q8_0") and name not in seen:
            seen.add(name)
            ours = from_gguf(t.data, name).dequantize()
            assert torch.equal(ours, torch.from_numpy(dequantize(t.data, t.tensor_type).copy()))
    assert seen == {"Q4_1", "Q8_0"}
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    raw = gguf_quantize(x, gguf.GGMLQuantizationType.Q4_0)
    ours = from_gguf(raw, "Q4_0").dequantize()
    assert torch.equal(ours, torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType.Q4_0)))


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_layout_is_a_permutation_that_unpacks_exactly(bits: int) -> None:
    """pack's tiles of 16 rows (N = 50 pads to 64) give back every row's codes, d and m."""
    w = quantize(torch.randn(50, 96, generator=_gen(bits)), bits)
    packed = pack(w.q, w.d, w.m, bits)
    assert packed.shape == (4, 3, 64 * bits + 64)
    rows = torch.tensor([0, 49, 17, 16, 15, 3])
    q, d, m = unpack_rows(packed, rows)
    assert torch.equal(q, w.q[rows]) and torch.equal(d, w.d[rows]) and torch.equal(m, w.m[rows])
    lin = QuantLinear(w, torch.float32)
    assert torch.equal(lin.weight.dequantize(), w.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemm_path_input_and_rope_equal_torch_ops(dtype: torch.dtype) -> None:
    """QGemm.prep (the GEMM path's input: RMSNorm, SiLU-mul, plain, rounded once to the
    model dtype) and RoPE on bfloat16 rows against the torch ops they replace."""
    gen, kernel, k = _gen(11), qgemm_kernel(), 96
    norm, x = Norm(k, gen), 3 * torch.randn(70, k, generator=gen)
    gate_up = (4 * torch.randn(70, 2 * k, generator=gen)).to(dtype)
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    silu = torch.nn.functional.silu(gate_up[:, :k].float()) * gate_up[:, k:].float()
    close = dict(rtol=2e-6 if dtype == torch.float32 else 8e-3, atol=1e-30)
    for got, want in ((kernel.prep(x, RMSNORM, norm.weight, norm.eps, dtype), normed),
                      (kernel.prep(gate_up, SILU_MUL, None, 0.0, dtype), silu),
                      (kernel.prep(x, PLAIN, None, 0.0, dtype), x)):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.to(dtype).float(), **close)
    qkv, cos, sin = (torch.randn(70, 5 * 16, generator=gen) for _ in range(3))
    cos, sin = cos[:, :16], sin[:, :16]
    wide, narrow = qkv.bfloat16().float(), qkv.bfloat16()
    kernel.rope(wide, 4, 16, cos, sin)
    kernel.rope(narrow, 4, 16, cos, sin)
    assert torch.equal(narrow, wide.bfloat16())
    assert torch.equal(narrow[:, 64:], qkv[:, 64:].bfloat16())  # past `heads`: untouched
    out, y = torch.randn(70, 80, generator=gen), qkv.bfloat16()
    assert torch.equal(kernel.add_into(out.clone(), y), out + y.float())  # the residual add


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("mode", [PLAIN, PRECISE, RMSNORM])
def test_amx_int8_tiles_give_the_vpdpbusd_loops_bits(bits: int, mode: int) -> None:
    """From 16 quantized rows the dot products may run on AMX int8 tiles (where the CPU has
    them): the same outputs, bit for bit, as the vpdpbusd loop (all rows on it)."""
    kernel = qgemm_kernel()
    gen = _gen(bits + mode)
    norm = Norm(576, gen)
    for n, k, rows in [(960, 576, 17), (40, 576, 33), (48, 576, 8)]:
        w = quantize(torch.randn(n, k, generator=gen), bits)
        packed = pack(w.q, w.d, w.m, bits)
        x = torch.randn(rows, k, generator=gen)
        out = torch.randn(rows, n, generator=gen)
        outs = []
        for amx_rows in (16, 1 << 30):
            previous = kernel.amx_rows(amx_rows)
            try:
                y = kernel(x, packed, n, mode=mode, norm_weight=norm.weight, eps=norm.eps)
                acc = kernel(x, packed, n, mode=mode, norm_weight=norm.weight, eps=norm.eps,
                             out=out.clone())
            finally:
                kernel.amx_rows(previous)
            outs.append((y, acc))
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
