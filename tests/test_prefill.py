"""Prefill attention in pieces (slimkv.attention.prefill) equals the reference attention, for chunks
cut into many pieces (``PIECE`` lowered to a few blocks), staged and unstaged caches."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from slimkv.attention import prefill
from slimkv.attention.layer import PagedAttention
from slimkv.backends import KERNELS
from slimkv.attention.metadata import AttentionMetadata
from slimkv.kernels.prefill_attn import prefill_kernel, prefill_kernel_unavailable_reason
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging

HEADS, KV_HEADS, D, BLOCK = 6, 2, 32, 4
SCALE = 1 / math.sqrt(D)


def _outputs(k_dtype: str, k_scale: str, chunks: list[int], fast: bool,
             dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One sequence fed in ``chunks`` (model dtype ``dtype``); every chunk's attention
    output, concatenated."""
    gen = torch.Generator().manual_seed(3)
    length = sum(chunks)
    cache = PagedKVCache(num_layers=1, num_blocks=length // BLOCK + 3, block_size=BLOCK,
                         num_kv_heads=KV_HEADS, head_dim=D, k_dtype=k_dtype, v_dtype=k_dtype,
                         k_scale=k_scale, device=torch.device("cpu"))
    staging = Staging(cache, 2, dtype) if cache.block_scaled else None
    attn = PagedAttention(cache, HEADS, SCALE, dtype, staging=staging,
                          backend=None if fast else "reference", kernels=KERNELS)
    q = (torch.randn(length, HEADS, D, generator=gen) * 2).to(dtype)
    k, v = ((torch.randn(length, KV_HEADS, D, generator=gen) * 2).to(dtype) for _ in range(2))
    table = list(range(1, length // BLOCK + 3))  # block 0 left to padding
    done, outs = 0, []
    for n in chunks:
        meta = AttentionMetadata.build(BLOCK, [table], [n], [done + n], torch.device("cpu"),
                                       None if staging is None else [1])
        rows = slice(done, done + n)
        outs.append(attn(0, q[rows], k[rows], v[rows], meta))
        done += n
    if k_dtype == "float32":  # also against dense causal attention
        dense = F.scaled_dot_product_attention(
            q.transpose(0, 1), *(t.repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
                                 for t in (k, v)), is_causal=True, scale=SCALE).transpose(0, 1)
        # two float32 algorithms (masked pieces vs one causal call), different summation
        # orders: up to ~1e-5 apart at |o| ~ 0.2 here; the exact-path check is the test below
        torch.testing.assert_close(torch.cat(outs), dense, rtol=1e-4, atol=1e-5)
    return torch.cat(outs)


@pytest.mark.parametrize("k_dtype, k_scale", [("float32", "per_token"), ("int8", "per_token"),
                                              ("int8", "per_channel_block"),
                                              ("int4", "per_channel_block")])
# chunks of 2+ tokens: every row a prefill row (a 1-token chunk is a decode, whose fused
# kernel is checked against its own integer reference in test_kernels.py)
@pytest.mark.parametrize("chunks", [[45], [6, 39], [13, 3, 28, 2]])
def test_pieces_equal_reference(monkeypatch, k_dtype: str, k_scale: str,
                                chunks: list[int]) -> None:
    monkeypatch.setattr(prefill, "PIECE", 2 * BLOCK)
    fast = _outputs(k_dtype, k_scale, chunks, fast=True)
    reference = _outputs(k_dtype, k_scale, chunks, fast=False)
    torch.testing.assert_close(fast, reference, rtol=0, atol=1e-5)


def test_plan_covers_each_query_once_with_the_keys_it_sees() -> None:
    """Pieces tile the chunk's rows; each row's visible keys are exactly its earlier
    positions (pool before its block, staged from its block on, itself included)."""
    seq_len, query_len = 45, 39
    staged_start = (seq_len - query_len) // BLOCK * BLOCK
    pieces = prefill.plan(seq_len, query_len, staged_start, BLOCK, torch.float32,
                          torch.device("cpu"), piece=8)
    rows = [r for p in pieces for r in range(p.rows.start, p.rows.stop)]
    assert rows == list(range(query_len))
    for p in pieces:
        staged_pos = torch.arange(seq_len)[p.staged.start + staged_start:
                                           p.staged.stop + staged_start]
        key_pos = torch.cat((torch.arange(p.num_pool_keys), staged_pos))
        for r, visible in zip(range(p.rows.start, p.rows.stop), p.mask == 0):
            pos = seq_len - query_len + r
            own = pos // BLOCK * BLOCK
            expected = torch.cat((key_pos[:p.num_pool_keys] < own,
                                  (staged_pos >= own) & (staged_pos <= pos)))
            assert torch.equal(visible, expected)
            assert sorted(key_pos[visible].tolist()) == list(range(pos + 1))


class _Counting:
    """The prefill kernel, recording per call whether it was causal (no mask)."""

    def __init__(self, kernel) -> None:
        self.kernel, self.causal = kernel, []

    def takes(self, *args) -> bool:
        return self.kernel.takes(*args)

    def __call__(self, q, k, v, mask, scale):
        self.causal.append(mask is None)
        return self.kernel(q, k, v, mask, scale)


@pytest.mark.parametrize("k_dtype, k_scale", [("bfloat16", "per_token"),
                                              ("int8", "per_channel_block")])
@pytest.mark.parametrize("chunks", [[45], [6, 39]])
def test_bf16_pieces_take_the_kernel_and_equal_reference(monkeypatch, k_dtype: str,
                                                         k_scale: str,
                                                         chunks: list[int]) -> None:
    """A bf16 model's pieces (causal and masked, staged and not) run in the prefill kernel
    where the CPU has one, and come out no further from the float32 reference than torch's
    SDPA on the same pieces (both read keys dequantized to bf16; the kernel's own bound is
    checked in test_prefill_kernel.py)."""
    kernel = prefill_kernel()
    if kernel is None:
        pytest.skip(prefill_kernel_unavailable_reason())
    counting = _Counting(kernel)
    monkeypatch.setattr(prefill, "PIECE", 2 * BLOCK)
    monkeypatch.setattr(prefill, "prefill_kernel", lambda: counting)
    fast = _outputs(k_dtype, k_scale, chunks, fast=True, dtype=torch.bfloat16)
    # every piece in the kernel; an unstaged cache's first chunk is one causal call
    assert counting.causal and any(counting.causal) == (k_dtype == "bfloat16")
    monkeypatch.setattr(prefill, "prefill_kernel", lambda: None)
    sdpa = _outputs(k_dtype, k_scale, chunks, fast=True, dtype=torch.bfloat16)
    reference = _outputs(k_dtype, k_scale, chunks, fast=False, dtype=torch.bfloat16).float()
    assert (fast.float() - reference).abs().max() <= (sdpa.float() - reference).abs().max()
