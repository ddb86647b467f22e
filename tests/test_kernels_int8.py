"""Keys with integer levels (int8; int4 with per-block channel scales) are dotted with an int8
copy of q in the fused decode kernel (see paged_decode.c). Checked against an independent
float64 reference over the same quantized pool that quantizes q as the kernel states it, and
against the plain float reference within the bound that q's rounding implies:

    |score error| <= eps = sq / 2 * sum_d |level_d| * (token scale)   (per key),
    |output error| <= (exp(2 * eps_max) - 1) * max|v|                  (per query head),

because softmax weights then move by at most a factor exp(+-2 eps).
"""

from __future__ import annotations

import pytest
import torch

from slimkv.attention import reference_paged_attention
from slimkv.kv.block_scales import ChannelBlockCodec, ChannelBlockInt4Codec
from slimkv.kv.quant import Int4Codec
from tests.test_kernels import _decode, _decode_step

INT_KEY_FORMATS = [("int8", "int8", "per_token"), ("int8", "int8", "per_channel_block"),
                   ("int4", "int4", "per_channel_block"), ("int8", "int4", "per_channel_block"),
                   ("int4", "bfloat16", "per_channel_block")]


def _levels(cache, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, bool]:
    """Key levels ``[nb, bs, H, D]`` (natural channel order), their scales (per token
    ``[nb, bs, H, 1]`` or per block ``[nb, H, D]``), zeros or None, and whether per block."""
    codec, pool = cache.layer_codecs[layer]["k"], cache.layer_pool("k", layer)
    block = isinstance(codec, (ChannelBlockCodec, ChannelBlockInt4Codec))
    int4 = isinstance(getattr(codec, "element", codec), Int4Codec)
    levels = (Int4Codec.unpack(pool.data) if int4 else pool.data).long()
    zero = pool.aux.get("zero")
    return levels, pool.aux["scale"].double(), None if zero is None else zero.double(), block


def int_key_reference(cache, staging, layer: int, q: torch.Tensor, meta, scale: float
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """(output ``[B, Hq, D]`` float64 with q quantized per block and head as the kernel
    does, eps ``[B, Hq]``: the largest score error q's rounding can cause)."""
    levels, k_scale, k_zero, block = _levels(cache, layer)
    bs, num_kv = cache.block_size, cache.num_kv_heads
    group = q.shape[1] // num_kv
    sm = torch.tensor(scale, dtype=torch.float32)
    out = torch.zeros(q.shape, dtype=torch.float64)
    eps = torch.zeros(q.shape[:2], dtype=torch.float64)
    for i, length in enumerate(meta.seq_lens):
        table = meta.block_tables[i, :-(-length // bs)]
        k, v = cache.read_prefix(layer, table[None], length, torch.float64)
        own = -1
        if staging is not None:
            own = (length - 1) // bs
            staging.overlay(layer, k, v, meta.staging_slots[i:i + 1], torch.tensor([own]))
        for head in range(q.shape[1]):
            h = head // group
            qp = q[i, head].float() * sm
            scores = torch.empty(length, dtype=torch.float64)
            for j, blk in enumerate(table.tolist()):
                rows = slice(j * bs, min(length, (j + 1) * bs))
                n = rows.stop - rows.start
                if j == own:
                    scores[rows] = k[0, rows, h] @ qp.double()
                    continue
                qt = qp * k_scale[blk, h].float() if block else qp
                amax = qt.abs().max()
                inv = torch.tensor(127.0) / amax if amax > 0 else torch.tensor(0.0)
                qi, sq = torch.round(qt * inv).long(), float(amax / 127.0)
                lv = levels[blk, :n, h]
                sk = 1.0 if block else k_scale[blk, :n, h, 0]
                bias = float(qp.double() @ k_zero[blk, h]) if k_zero is not None else 0.0
                scores[rows] = sq * (lv @ qi).double() * sk + bias
                err = sq / 2 * lv.abs().sum(-1).double() * sk
                eps[i, head] = max(float(eps[i, head]), float(torch.as_tensor(err).max()))
            probs = scores.softmax(0)
            out[i, head] = probs @ v[0, :length, h]
    return out, eps


@pytest.mark.usefixtures("fused_kernel")
@pytest.mark.parametrize("head_dim", [64, 128, 32])  # 32: the portable block loops
@pytest.mark.parametrize("k_dtype, v_dtype, k_scale", INT_KEY_FORMATS)
def test_int8_q_dots_match_their_float64_reference_and_bound(k_dtype: str, v_dtype: str,
                                                              k_scale: str, head_dim: int
                                                              ) -> None:
    lens = [1, 16, 17, 40, 100, 300]
    cache, staging, step, meta = _decode_step(k_dtype, v_dtype, k_scale, head_dim, lens,
                                              torch.float32)
    fused, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True)
    assert attn.path_counts == {"fused_decode": 1}
    expected, eps = int_key_reference(cache, staging, 0, step[0], meta, head_dim ** -0.5)
    torch.testing.assert_close(fused.double(), expected, rtol=1e-5, atol=1e-5)
    # against attention with q unquantized: within the bound q's rounding implies
    plain = reference_paged_attention(cache, 0, step[0], meta, head_dim ** -0.5,
                                      torch.float32, staging).double()
    v_max = max(float(cache.read_prefix(0, meta.block_tables[i:i + 1], n, torch.float32)[1]
                      .abs().max()) for i, n in enumerate(meta.seq_lens))
    if staging is not None:
        v_max = max(v_max, float(staging.buffer[1].abs().max()))
    bound = (torch.exp(2 * eps) - 1) * v_max + 1e-5
    error = (fused.double() - plain).abs().amax(-1)
    assert (error <= bound).all(), (error / bound).max()
    assert eps.max() > 0 and error.max() > 0  # q really was quantized here


@pytest.mark.usefixtures("fused_kernel")
def test_fused_decode_reads_each_layer_with_its_own_codec() -> None:
    """kv_cache.layer_dtypes: layer 1 stored in int4 while the default is int8."""
    cache, staging, step, meta = _decode_step("int8", "int8", "per_channel_block", 64, [7, 40],
                                              torch.float32, layer=1,
                                              layer_dtypes={"int4": [1]})
    assert cache.layer_codecs[1]["k"].name == "int4"
    fused, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True, layer=1)
    expected, _ = int_key_reference(cache, staging, 1, step[0], meta, 64 ** -0.5)
    assert attn.path_counts == {"fused_decode": 1}
    torch.testing.assert_close(fused.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
def test_fused_decode_in_bfloat16_model_dtype() -> None:
    cache, staging, step, meta = _decode_step("int8", "int8", "per_channel_block", 64, [5, 33],
                                              torch.bfloat16)
    fused, attn = _decode(cache, staging, step, meta, torch.bfloat16, kernel=True)
    expected, _ = int_key_reference(cache, staging, 0, step[0], meta, 64 ** -0.5)
    assert attn.path_counts == {"fused_decode": 1} and fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.double(), expected, rtol=0, atol=2e-2)
