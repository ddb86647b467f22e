"""The bf16 prefill attention kernel (slimkv/kernels/prefill_attention.c) against float32
attention on the same bf16 operands: causal with and without an offset, additive masks,
head dims 32-256, grouped query heads, ragged row counts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from slimkv.kernels.prefill_attn import prefill_kernel, prefill_kernel_unavailable_reason
from slimkv.kv.staging import staged_mask


@pytest.fixture(scope="module")
def kernel():
    loaded = prefill_kernel()
    if loaded is None:
        pytest.skip(prefill_kernel_unavailable_reason())
    return loaded


def _float_attention(q, k, v, mask, scale):
    """float32 SDPA of the bf16 operands; causal (mask None) means query i sees keys
    0 .. i + L - n."""
    n, num_keys = q.shape[0], k.shape[0]
    if mask is None:
        mask = torch.ones(n, num_keys, dtype=torch.bool).tril(num_keys - n)
    else:
        mask = mask.float()
    q, k, v = (x.float().transpose(0, 1)[None] for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                          enable_gqa=True)[0].transpose(0, 1)


def _random_mask(n: int, num_keys: int, gen: torch.Generator) -> torch.Tensor:
    """Additive bf16 [n, L]: ~30% of keys hidden at random, key 0 always visible."""
    visible = torch.rand(n, num_keys, generator=gen) < 0.7
    visible[:, 0] = True
    return torch.zeros(n, num_keys, dtype=torch.bfloat16).masked_fill_(~visible, float("-inf"))


@pytest.mark.parametrize("n, num_keys, head_dim, heads, masked", [
    (512, 512, 64, (9, 3), False),   # SmolLM2's chunk that starts a sequence
    (100, 612, 64, (9, 3), False),   # a later chunk: causal with an offset
    (37, 37, 128, (8, 2), False),    # rows not a multiple of 16, G = 4
    (17, 1000, 256, (4, 4), False),  # G = 1, long keys
    (128, 300, 64, (9, 3), True),    # a staged piece's additive mask
    (50, 50, 32, (6, 2), True),
])
def test_kernel_within_bf16_rounding_of_float_attention(kernel, n: int, num_keys: int,
                                                        head_dim: int, heads: tuple,
                                                        masked: bool) -> None:
    """Q.K products are exact (bf16 x bf16 in float32), softmax and P.V are float32, the
    output is rounded to bf16 once (<= 2^-9 relative): so |kernel - float32| <= 2^-8 |ref|
    + 1e-5 leaves room for float32 summation order only."""
    gen = torch.Generator().manual_seed(n + num_keys)
    num_heads, num_kv_heads = heads
    q = (torch.randn(n, num_heads, head_dim, generator=gen) * 2).bfloat16()
    k = (torch.randn(num_keys, num_kv_heads, head_dim, generator=gen) * 2).bfloat16()
    v = torch.randn(num_keys, num_kv_heads, head_dim, generator=gen).bfloat16()
    mask = _random_mask(n, num_keys, gen) if masked else None
    assert kernel.takes(q, k, v, mask)
    scale = head_dim ** -0.5
    out = kernel(q, k, v, mask, scale)
    reference = _float_attention(q, k, v, mask, scale)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    error = (out.float() - reference).abs()
    assert (error <= 2.0 ** -8 * reference.abs() + 1e-5).all(), error.max()


def test_kernel_skips_tiles_a_staged_mask_hides(kernel) -> None:
    """A staged piece's mask (pool keys before each query's block, staged keys of its own
    block up to itself) hides whole 16 x 16 tiles, which the kernel skips: same bound."""
    gen = torch.Generator().manual_seed(1)
    rows, pool, staged = 128, 240, 128  # rows at positions 128 .. 255, a 16-token block
    visible = staged_mask(256, rows, pool, 128, staged, 16, torch.device("cpu"))
    mask = torch.zeros(visible.shape, dtype=torch.bfloat16).masked_fill_(~visible, float("-inf"))
    q = (torch.randn(rows, 9, 64, generator=gen) * 2).bfloat16()
    k = (torch.randn(pool + staged, 3, 64, generator=gen) * 2).bfloat16()
    v = torch.randn(pool + staged, 3, 64, generator=gen).bfloat16()
    out = kernel(q, k, v, mask, 0.125)
    reference = _float_attention(q, k, v, mask, 0.125)
    error = (out.float() - reference).abs()
    assert (error <= 2.0 ** -8 * reference.abs() + 1e-5).all(), error.max()


def test_kernel_reads_strided_rows(kernel) -> None:
    """q, k, v as views into wider rows (a fused QKV projection's output)."""
    gen = torch.Generator().manual_seed(0)
    n, num_heads, num_kv_heads, head_dim = 40, 6, 2, 64
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(n, width, generator=gen).bfloat16()
    q = qkv[:, :num_heads * head_dim].view(n, num_heads, head_dim)
    k = qkv[:, num_heads * head_dim:(num_heads + num_kv_heads) * head_dim].view(
        n, num_kv_heads, head_dim)
    v = qkv[:, (num_heads + num_kv_heads) * head_dim:].view(n, num_kv_heads, head_dim)
    assert kernel.takes(q, k, v, None)
    out = kernel(q, k, v, None, 0.125)
    expected = kernel(q.contiguous(), k.contiguous(), v.contiguous(), None, 0.125)
    assert torch.equal(out, expected)


def test_kernel_declines_what_it_does_not_read(kernel) -> None:
    q = torch.randn(8, 4, 64).bfloat16()
    k = v = torch.randn(8, 2, 64).bfloat16()
    assert not kernel.takes(q.float(), k.float(), v.float(), None)  # float32 model
    assert not kernel.takes(q[..., :48], k[..., :48], v[..., :48], None)  # head dim 48
    assert not kernel.takes(q.transpose(0, 1).contiguous().transpose(0, 1), k, v, None)
    assert not kernel.takes(q, k, v, torch.zeros(8, 8))  # a float32 mask
    with FakeTensorMode() as mode:  # memory profiling: no data to read
        fake = [mode.from_tensor(x) for x in (q, k, v)]
        assert not kernel.takes(*fake, None)
