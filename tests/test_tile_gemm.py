"""The AMX tile GEMM (slimkv/kernels/tile_gemm.c) against a float64 torch reference over the
same bf16 weights, and its place in QuantLinear's GEMM path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimkv.kernels.qgemm import pack
from slimkv.kernels.tile_gemm import tile_gemm_kernel
from slimkv.model.quant import QuantLinear
from slimkv.model_io.convert import quantize

pytestmark = pytest.mark.skipif(tile_gemm_kernel() is None,
                                reason="no AMX bf16 tiles on this CPU (or no kernel build)")
# M: blocks of 32 rows and remainders; N: odd tile counts, N % 16 != 0
SHAPES = [(65, 64, 576), (100, 48, 96), (33, 40, 1536), (512, 960, 576)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES)
def test_tile_gemm_is_a_bf16_rounded_float32_sum_of_bf16_products(bits, shape) -> None:
    m, n, k = shape
    gen = torch.Generator().manual_seed(m + n + k + bits)
    w = quantize(torch.randn(n, k, generator=gen), bits)
    a = (torch.randn(m, k, generator=gen) * 3).bfloat16()
    wb = w.dequantize().bfloat16()  # torch: d * q + m in float32, rounded to bf16
    y = tile_gemm_kernel()(a, pack(w.q, w.d, w.m, bits), n)
    exact = a.double() @ wb.double().T
    mag = a.double().abs() @ wb.double().abs().T
    # float32 accumulation (K terms, <= K * 2^-24 relative to sum |a w|), then one
    # rounding to bf16 (<= 2^-9 relative)
    bound = 2.0 ** -8 * exact.abs() + k * 2.0 ** -23 * mag
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert ((y.double() - exact).abs() <= bound).all()
    # added into a float32 residual: exactly the bf16 result's values
    out = torch.randn(m, n, generator=gen)
    expect = out + y.float()
    assert tile_gemm_kernel()(a, pack(w.q, w.d, w.m, bits), n, out=out) is out
    assert torch.equal(out, expect)


def test_quant_linear_gemm_path_takes_tiles_and_matches_torch() -> None:
    gen = torch.Generator().manual_seed(7)
    w = quantize(torch.randn(96, 576, generator=gen), 4)
    lin = QuantLinear(w, torch.bfloat16)
    assert lin.tiles is not None
    x = torch.randn(80, 576, generator=gen)  # > kernel_rows: the GEMM path
    y = lin.fused(x)
    ref = F.linear(x.bfloat16(), w.dequantize().bfloat16()).float()
    torch.testing.assert_close(y, ref, rtol=2.0 ** -7, atol=576 * 2.0 ** -20 * 40)
    lin.tiles = None  # torch's GEMM over the dequantized weights
    torch.testing.assert_close(lin.fused(x), y, rtol=2.0 ** -7, atol=576 * 2.0 ** -20 * 40)
