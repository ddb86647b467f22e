"""Row buckets for float GEMMs (slimkv/model/gemm.py): how many distinct shapes reach the
matmul, and that the kept rows are the unpadded product's (against float64)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slimkv.kernels.qgemm import qgemm_kernel
from slimkv.model import gemm
from slimkv.model.gemm import EXACT_ROWS, ROW_BUCKET, Linear, bucket_rows, linear
from slimkv.model.llama import ModelArgs, Transformer
from slimkv.model.quant import QuantLinear
from slimkv.model_io.convert import quantize

BF16_ULP = 2.0 ** -7   # bf16 keeps 8 significant bits: half an ulp is 2^-8 relative
UNPADDED = F.linear    # torch's own, before the spy below replaces it


@pytest.fixture
def gemm_rows(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The row counts of every matmul gemm.linear hands to torch."""
    seen: list[int] = []
    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        seen.append(x.shape[0])
        return UNPADDED(x, w, b)

    monkeypatch.setattr(gemm.F, "linear", spy)
    return seen


def test_buckets() -> None:
    assert [bucket_rows(n) for n in range(1, EXACT_ROWS + 1)] == list(range(1, EXACT_ROWS + 1))
    for n in range(EXACT_ROWS + 1, 2049):
        b = bucket_rows(n)
        assert n <= b < n + ROW_BUCKET and b % ROW_BUCKET == 0


def test_bf16_rows_reach_the_gemm_in_buckets_and_keep_their_values(gemm_rows) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    for rows in range(1, 513):
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        y = linear(x, w, bias)
        assert y.shape == (rows, 96) and y.is_contiguous()
        ref = x.double() @ w.double().T + bias.double()
        # one bf16 rounding of each sum (plus float32 accumulation): within an ulp of it
        assert ((y.double() - ref).abs() <= BF16_ULP * ref.abs() + 1e-2).all(), rows
        if rows % 37 == 0:   # the same rows as the unpadded product
            torch.testing.assert_close(y, UNPADDED(x, w, bias), rtol=BF16_ULP, atol=1e-2)
    assert set(gemm_rows) == {*range(1, EXACT_ROWS + 1),
                              *range(EXACT_ROWS + ROW_BUCKET, 513, ROW_BUCKET)}


def test_float32_and_other_devices_are_not_padded(gemm_rows) -> None:
    x, w = torch.randn(100, 8), torch.randn(4, 8)
    torch.testing.assert_close(linear(x, w), x @ w.T)
    assert gemm_rows == [100]


def test_the_float_model_and_the_quantized_gemm_path_take_buckets(gemm_rows) -> None:
    args = ModelArgs(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                     num_layers=1, num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=1e4,
                     rms_norm_eps=1e-6, max_position_embeddings=128, tie_word_embeddings=True,
                     attention_bias=False)
    model = Transformer(args, torch.bfloat16, torch.device("cpu"))
    assert isinstance(model.layers[0].attention.wqkv, Linear)
    x = torch.randn(70, 32).bfloat16()
    model.layers[0].feed_forward.w13(x)
    model.compute_logits(x)
    assert gemm_rows == [80, 80]
    if qgemm_kernel() is not None:
        lin = QuantLinear(quantize(torch.randn(48, 64), 4), torch.bfloat16)
        lin.tiles = None   # the dequantize + torch GEMM path (AMX CPUs take tile_gemm)
        gemm_rows.clear()
        lin.fused(torch.randn(QuantLinear.kernel_rows + 3, 64).bfloat16())
        assert gemm_rows == [bucket_rows(QuantLinear.kernel_rows + 3)]
