"""Paged attention: fast path == reference == dense causal attention, chunking invariance."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from slimkv.attention.layer import PagedAttention
from slimkv.backends import KERNELS
from slimkv.attention.metadata import AttentionMetadata
from slimkv.kv.cache import PagedKVCache

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, NUM_BLOCKS = 6, 2, 32, 4, 24
SCALE = 1 / math.sqrt(HEAD_DIM)
LAYER = 1
# (context length, new tokens this step): decodes and prefills (fresh and with a prefix), mixed.
MIXED_BATCH = [(9, 1), (5, 5), (1, 1), (11, 3), (4, 1), (16, 7)]


@dataclass
class Sequence:
    q: torch.Tensor  # [L, NUM_HEADS, D], the whole sequence
    k: torch.Tensor  # [L, NUM_KV_HEADS, D]
    v: torch.Tensor
    blocks: list[int]

    def slots(self, start: int, end: int) -> torch.Tensor:
        pos = torch.arange(start, end)
        return torch.tensor(self.blocks)[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE


def _sequences(lengths: list[int], seed: int = 0) -> list[Sequence]:
    """Random sequences on shuffled, non-contiguous blocks; block 0 is left to padding."""
    gen = torch.Generator().manual_seed(seed)
    free = (torch.randperm(NUM_BLOCKS - 1, generator=gen) + 1).tolist()
    seqs = []
    for length in lengths:
        num_blocks = -(-length // BLOCK_SIZE)
        blocks, free = free[:num_blocks], free[num_blocks:]
        seqs.append(Sequence(torch.randn(length, NUM_HEADS, HEAD_DIM, generator=gen),
                             torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen),
                             torch.randn(length, NUM_KV_HEADS, HEAD_DIM, generator=gen), blocks))
    return seqs


def _cache(dtype: str = "float32", v_dtype: str | None = None) -> PagedKVCache:
    cache = PagedKVCache(num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                         num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, k_dtype=dtype,
                         v_dtype=v_dtype or dtype, k_scale="per_token",
                         device=torch.device("cpu"))
    junk = torch.full((BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM), 1e3)  # must never be attended
    cache.write(LAYER, torch.arange(BLOCK_SIZE), junk, junk)
    return cache


def _step(cache: PagedKVCache, seqs: list[Sequence], batch: list[tuple[int, int]],
          write_prefix: bool = True
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Build the step for tokens [L - n, L) of each sequence, first caching [0, L - n)
    unless an earlier step already did."""
    ranges = [(seq_len - q_len, seq_len) for seq_len, q_len in batch]
    for seq, (start, _) in zip(seqs, ranges):
        if start and write_prefix:
            cache.write(LAYER, seq.slots(0, start), seq.k[:start], seq.v[:start])
    max_blocks = max(len(seq.blocks) for seq in seqs)
    query_lens = [q_len for _, q_len in batch]
    seq_lens = [seq_len for seq_len, _ in batch]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([seq.slots(s, e) for seq, (s, e) in zip(seqs, ranges)]),
        query_start_loc=[0, *torch.tensor(query_lens).cumsum(0).tolist()],
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_tables=torch.tensor([seq.blocks + [0] * (max_blocks - len(seq.blocks))
                                   for seq in seqs]),
        seq_lens_t=torch.tensor(seq_lens),
        block_size=BLOCK_SIZE,
    )
    q, k, v = (torch.cat([getattr(seq, name)[s:e] for seq, (s, e) in zip(seqs, ranges)])
               for name in "qkv")
    return q, k, v, meta


def _dense(seqs: list[Sequence], batch: list[tuple[int, int]]) -> torch.Tensor:
    """Each sequence on its own: full causal attention, keeping the step's last rows."""
    group = NUM_HEADS // NUM_KV_HEADS
    outs = []
    for seq, (_, q_len) in zip(seqs, batch):
        k, v = (t.repeat_interleave(group, dim=1).transpose(0, 1) for t in (seq.k, seq.v))
        out = F.scaled_dot_product_attention(seq.q.transpose(0, 1), k, v, is_causal=True,
                                             scale=SCALE)
        outs.append(out.transpose(0, 1)[-q_len:])
    return torch.cat(outs)


def _run(batch: list[tuple[int, int]], *, fast: bool, dtype: str = "float32",
         v_dtype: str | None = None, model_dtype: torch.dtype = torch.float32,
         backend: str | None = None) -> tuple[torch.Tensor, PagedAttention]:
    seqs = _sequences([seq_len for seq_len, _ in batch])
    cache = _cache(dtype, v_dtype)
    attn = PagedAttention(cache, NUM_HEADS, SCALE, model_dtype,
                          backend=backend or (None if fast else "reference"), kernels=KERNELS)
    q, k, v, meta = _step(cache, seqs, batch)
    return attn(LAYER, q.to(model_dtype), k.to(model_dtype), v.to(model_dtype), meta), attn


def test_fast_and_reference_equal_dense_attention() -> None:
    expected = _dense(_sequences([seq_len for seq_len, _ in MIXED_BATCH]), MIXED_BATCH)
    fast, _ = _run(MIXED_BATCH, fast=True)
    reference, _ = _run(MIXED_BATCH, fast=False)
    assert fast.shape == (sum(n for _, n in MIXED_BATCH), NUM_HEADS, HEAD_DIM)
    torch.testing.assert_close(fast, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(reference, expected, rtol=0, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
def test_path_counts() -> None:
    _, fast = _run(MIXED_BATCH, fast=True)
    assert fast.path_counts == {"fused_decode": 1, "fast_prefill": 1}
    _, decode_only = _run([(9, 1), (3, 1)], fast=True)
    assert decode_only.path_counts == {"fused_decode": 1}
    _, reference = _run(MIXED_BATCH, fast=False)
    assert reference.path_counts == {"reference": 1}


@pytest.mark.parametrize("dtype", ["float32", "int8", "int4"])
def test_chunked_prefill_equals_unchunked(dtype: str) -> None:
    whole, _ = _run([(14, 14)], fast=True, dtype=dtype)
    seqs = _sequences([14])
    cache = _cache(dtype)
    attn = PagedAttention(cache, NUM_HEADS, SCALE, torch.float32, kernels=KERNELS)
    first = attn(LAYER, *_step(cache, seqs, [(6, 6)]))
    second = attn(LAYER, *_step(cache, seqs, [(14, 8)], write_prefix=False))
    torch.testing.assert_close(torch.cat([first, second]), whole, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype, v_dtype", [("int8", None), ("fp8", None), ("int8", "int4")])
def test_quantized_kv_fast_matches_reference(dtype: str, v_dtype: str | None) -> None:
    fast, _ = _run(MIXED_BATCH, fast=True, dtype=dtype, v_dtype=v_dtype)
    reference, _ = _run(MIXED_BATCH, fast=False, dtype=dtype, v_dtype=v_dtype)
    torch.testing.assert_close(fast, reference, rtol=0, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "triton"])
@pytest.mark.parametrize("dtype, v_dtype", [("float32", None), ("int8", None),
                                            ("fp8_e4m3", "int4"), ("bfloat16", None)])
def test_every_backend_equals_the_reference(backend: str, dtype: str, v_dtype: str | None) -> None:
    """Each backend chosen by name, one mixed step (decodes, fresh and prefixed prefill
    chunks), against the reference backend: the paths it counts are its own."""
    from slimkv.backends.cpu_decode import kernel_unavailable_reason

    if backend == "cpu" and kernel_unavailable_reason() is not None:
        pytest.skip(kernel_unavailable_reason())
    if backend == "triton":
        pytest.importorskip("triton")
    out, attn = _run(MIXED_BATCH, fast=True, dtype=dtype, v_dtype=v_dtype, backend=backend)
    reference, _ = _run(MIXED_BATCH, fast=False, dtype=dtype, v_dtype=v_dtype)
    torch.testing.assert_close(out, reference, rtol=0, atol=1e-5)
    backend_paths = {"cpu": {"fused_decode", "fast_prefill"},
                     "sdpa": {"fast_decode", "fast_prefill"},
                     "triton": {"triton_decode", "triton_prefill"}}
    assert set(attn.path_counts) == backend_paths[backend]


def test_an_unknown_or_unavailable_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention backend 'cuda'"):
        PagedAttention(_cache(), NUM_HEADS, SCALE, torch.float32, backend="cuda",
                       kernels=KERNELS)
    # The fused C kernel reads no pool on another device: asked for, it says why.
    cache = PagedKVCache(num_layers=1, num_blocks=2, block_size=BLOCK_SIZE,
                         num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, k_dtype="float32",
                         v_dtype="float32", k_scale="per_token", device=torch.device("meta"))
    with pytest.raises(ValueError, match="backend 'cpu' cannot run"):
        PagedAttention(cache, NUM_HEADS, SCALE, torch.float32, backend="cpu", kernels=KERNELS)


@pytest.mark.parametrize("dtype, v_dtype, atol", [
    ("int8", None, 0.02), ("fp8", None, 0.15), ("int8", "int4", 0.25)])
def test_quantized_kv_close_to_float(dtype: str, v_dtype: str | None, atol: float) -> None:
    exact, _ = _run(MIXED_BATCH, fast=True)
    quantized, _ = _run(MIXED_BATCH, fast=True, dtype=dtype, v_dtype=v_dtype)
    torch.testing.assert_close(quantized, exact, rtol=0, atol=atol)


def test_bfloat16_model_dtype() -> None:
    fast, _ = _run(MIXED_BATCH, fast=True, dtype="bfloat16", model_dtype=torch.bfloat16)
    reference, _ = _run(MIXED_BATCH, fast=False, dtype="bfloat16", model_dtype=torch.bfloat16)
    assert fast.dtype == reference.dtype == torch.bfloat16
    torch.testing.assert_close(fast.float(), reference.float(), rtol=0, atol=3e-2)


def test_rejects_heads_not_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        PagedAttention(_cache(), 5, SCALE, torch.float32, kernels=KERNELS)
