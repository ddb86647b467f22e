"""KV element formats: round-trip error bounds, storage layout, byte accounting."""

from __future__ import annotations

import pytest
import torch

from slimkv.kv.quant import KV_CODEC_NAMES, Int4Codec, make_codec

HEAD_DIM = 64


def _sample(seed: int = 0) -> torch.Tensor:
    """[N, H, D] with per-head magnitudes over several decades, an offset and an outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(37, 3, HEAD_DIM, generator=gen)
    x = x * torch.logspace(-3, 2, 37)[:, None, None] + 0.5
    x[5, 1, 7] = 300.0
    return x


@pytest.mark.parametrize("name", ["float32", "float16", "bfloat16"])
def test_float_formats_store_values_as_is(name: str) -> None:
    codec = make_codec(name, HEAD_DIM)
    x = _sample()
    q = codec.quantize(x)
    assert q.aux == {} and q.data.dtype == codec.storage_dtype
    torch.testing.assert_close(codec.dequantize(q, torch.float32), x.to(q.data.dtype).float(),
                               rtol=0, atol=0)


def test_int8_error_is_at_most_half_a_step() -> None:
    codec = make_codec("int8", HEAD_DIM)
    x = _sample()
    q = codec.quantize(x)
    assert q.data.dtype == torch.int8 and q.data.shape == x.shape
    scale = q.aux["scale"]
    assert scale.dtype == torch.float16 and scale.shape == (*x.shape[:-1], 1)
    err = (codec.dequantize(q, torch.float32) - x).abs()
    assert (err <= scale.float() / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize("name, mantissa_bits, min_normal_exp, min_sub_exp", [
    ("fp8_e4m3", 3, -6, -9),
    ("fp8_e5m2", 2, -14, -16),
])
def test_fp8_relative_error_bound(name: str, mantissa_bits: int, min_normal_exp: int,
                                  min_sub_exp: int) -> None:
    codec = make_codec(name, HEAD_DIM)
    x = _sample()
    q = codec.quantize(x)
    assert q.data.element_size() == 1 and q.data.shape == x.shape
    scale = q.aux["scale"].float()
    err = (codec.dequantize(q, torch.float32) - x).abs()
    # Normal range: half an ulp relative; below the smallest normal: half the subnormal step.
    bound = torch.maximum(x.abs() * 2.0 ** -(mantissa_bits + 1), scale * 2.0 ** (min_sub_exp - 1))
    assert (err <= bound * (1 + 1e-3) + 1e-7).all()
    assert 2.0**min_normal_exp == torch.finfo(codec.fp8_dtype).tiny


def test_fp8_alias_is_e4m3() -> None:
    assert make_codec("fp8", HEAD_DIM).name == "fp8_e4m3"


@pytest.mark.parametrize("group_size", [32, 16])
def test_int4_error_is_at_most_half_a_step_per_group(group_size: int) -> None:
    codec = make_codec("int4", HEAD_DIM, group_size=group_size)
    x = _sample()
    q = codec.quantize(x)
    groups = HEAD_DIM // group_size
    assert q.data.dtype == torch.uint8 and q.data.shape == (*x.shape[:-1], HEAD_DIM // 2)
    assert q.aux["scale"].shape == q.aux["zero"].shape == (*x.shape[:-1], groups)
    err = (codec.dequantize(q, torch.float32) - x).abs().unflatten(-1, (groups, group_size))
    assert (err <= q.aux["scale"].float()[..., None] / 2 * (1 + 1e-4)).all()


def test_int4_packs_two_nibbles_per_byte() -> None:
    codec = make_codec("int4", 32)
    codes = torch.tensor([0, 15, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14] * 2)
    x = codes.float().view(1, 1, 32)  # min 0, max 15: zero ~0, scale ~1, codes unchanged
    q = codec.quantize(x)
    expected = [0 | 15 << 4, 1 | 2 << 4, 3 | 4 << 4, 5 | 6 << 4,
                7 | 8 << 4, 9 | 10 << 4, 11 | 12 << 4, 13 | 14 << 4] * 2
    assert q.data.flatten().tolist() == expected
    torch.testing.assert_close(codec.dequantize(q, torch.float32), x, rtol=0, atol=0.02)


def test_constant_and_zero_inputs_round_trip() -> None:
    for name in ("int8", "fp8_e4m3", "fp8_e5m2", "int4"):
        codec = make_codec(name, HEAD_DIM)
        for value in (0.0, 3.0, -2.5):
            x = torch.full((2, 1, HEAD_DIM), value)
            out = codec.dequantize(codec.quantize(x), torch.float32)
            assert torch.isfinite(out).all(), name
            torch.testing.assert_close(out, x, rtol=2e-2, atol=1e-4, msg=name)


@pytest.mark.parametrize("name, expected", [
    ("float32", 256), ("float16", 128), ("bfloat16", 128),
    ("int8", 66), ("fp8", 66), ("fp8_e4m3", 66), ("fp8_e5m2", 66), ("int4", 40),
])
def test_bytes_per_token_head(name: str, expected: int) -> None:
    assert make_codec(name, HEAD_DIM).bytes_per_token_head() == expected


def test_every_config_name_has_a_codec() -> None:
    assert set(KV_CODEC_NAMES) == {"float32", "float16", "bfloat16", "int8", "fp8", "fp8_e4m3",
                                   "fp8_e5m2", "int4"}


def test_dequantize_keeps_leading_dims_and_dtype() -> None:
    codec = make_codec("int4", HEAD_DIM)
    x = torch.randn(2, 3, 4, 5, HEAD_DIM)
    out = codec.dequantize(codec.quantize(x), torch.bfloat16)
    assert out.shape == x.shape and out.dtype == torch.bfloat16


def test_unknown_dtype_names_it() -> None:
    with pytest.raises(ValueError, match="int3"):
        make_codec("int3", HEAD_DIM)


def test_int4_rejects_group_not_dividing_head_dim() -> None:
    with pytest.raises(ValueError, match="group"):
        Int4Codec("int4", 48, group_size=32)
