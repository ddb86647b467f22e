"""kernels/kv_blocks.c (slimkv/backends/cpu_kv.py): int8 blocks quantized into the pool and
dequantized out of it bit for bit as the codecs do (codes, scales, decoded values), for both
key scale layouts, every input/output dtype, shuffled block ids."""

from __future__ import annotations

import pytest
import torch

from slimkv.backends.cpu_kv import CpuPoolWriter, int8_mode, kv_blocks_kernel
from slimkv.kv.cache import PagedKVCache

BS, H, D = 16, 3, 64


def blocks(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """Random blocks with ties (x.5 after scaling), zeros, whole zero channels/tokens,
    an outlier channel and large values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, BS, H, D, generator=g) * torch.rand(n, 1, H, 1, generator=g) * 4
    x[..., 5] *= 40                                   # an outlier channel
    x[:, 3] = 0                                       # a zero token
    x[..., 9] = 0                                     # a zero channel
    x[:, :, 0, 10] = (torch.rand(n, BS, generator=g) * 2 - 1) * 65000  # large (float16's max)
    # ties, k + 0.5 after dividing by a scale of 1: per token (token 7, absmax 127) and per
    # channel (channels 16-23, absmax 127 in token 6)
    x[:, 7, :, 5], x[:, 7, 0, 10] = 0, 0
    x[:, 7, :, 16:24], x[:, 7, :, 24], x[:, 6, :, 16:24] = torch.arange(-4, 4) + 0.5, 127, 127
    x[:, 11, 1] = 1e-9                                # a tiny token: scale clamped at tiny
    return x.to(dtype)


def cache(k_scale: str) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_blocks=40, block_size=BS, num_kv_heads=H, head_dim=D,
                        k_dtype="int8", v_dtype="int8", k_scale=k_scale, device="cpu")


def kernel():
    kv = kv_blocks_kernel()
    if kv is None:
        pytest.skip("kv_blocks.c cannot be built here")
    return kv


@pytest.mark.parametrize("k_scale", ["per_channel_block", "per_token"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_and_read_match_the_codecs(k_scale: str, dtype: torch.dtype) -> None:
    kv = kernel()
    ids = torch.randperm(40, generator=torch.Generator().manual_seed(1))[:12]
    ours, theirs = cache(k_scale), cache(k_scale)
    ours.writer = CpuPoolWriter(ours, kv)
    for layer in range(2):
        k, v = blocks(12, 2 * layer, dtype), blocks(12, 2 * layer + 1, dtype)
        if layer:  # as a chunk's K leaves the projection: token rows wider than H * D
            k = torch.cat((k, torch.full_like(k, 1e4)), 2)[:, :, :H]
            assert k.stride(1) == 2 * H * D
        ours.write_blocks(layer, ids, k, v)
        theirs.write_blocks(layer, ids, k, v)
    for name, t in theirs.tensors().items():
        assert torch.equal(ours.tensors()[name], t), name
    read = torch.randperm(40, generator=torch.Generator().manual_seed(3))[:20]
    for layer in range(2):
        for side in ("k", "v"):
            mode = int8_mode(ours.layer_codecs[layer][side])
            for out in (torch.bfloat16, torch.float32, torch.float16):
                want = theirs._read_side(side, layer, read, out)
                got = kv.read(ours.layer_pool(side, layer), mode, read, out, 20 * BS + 7)
                assert torch.equal(got[:20 * BS], want), (side, out)


def _attention_run(kernels: bool, k_scale: str, dtype: torch.dtype, piece_dtype: bool):
    """Two sequences fed in chunks (mid-block chunk starts, several 128-row pieces, a prefix
    of blocks already in the pool, decodes) through the CPU backend, with or without
    (``kernels``) the kv_blocks kernel: outputs and pool."""
    from slimkv.attention.layer import PagedAttention
    from slimkv.attention.metadata import AttentionMetadata
    from slimkv.backends import KERNELS
    from slimkv.kv.staging import Staging

    pool = PagedKVCache(num_layers=2, num_blocks=72, block_size=BS, num_kv_heads=H,
                        head_dim=D, k_dtype="int8", v_dtype="int8", k_scale=k_scale,
                        device="cpu")
    staging = Staging(pool, 2, dtype) if pool.block_scaled else None
    attn = PagedAttention(pool, 2 * H, D ** -0.5, dtype, staging=staging, backend="cpu",
                          kernels=KERNELS)
    assert attn.backend.blocks is not None
    if not kernels:
        attn.backend.blocks = pool.writer = None
    gen = torch.Generator().manual_seed(7)
    tables = [[int(b) for b in torch.randperm(40, generator=gen)[:26]], list(range(40, 66))]
    done, outs = [0, 0], []
    for step in ([300, 37], [5, 250], [1, 1], [90, 1]):
        seq_lens = [d + n for d, n in zip(done, step)]
        meta = AttentionMetadata.build(BS, tables, step, seq_lens, torch.device("cpu"),
                                       [0, 1] if staging else None,
                                       dtype if piece_dtype else None)
        for layer in range(2):
            q, k, v = (torch.randn(sum(step), h, D, generator=gen).to(dtype) * 3
                       for h in (2 * H, H, H))
            outs.append(attn(layer, q, k, v, meta))
        done = seq_lens
    return torch.cat(outs), pool.tensors()


@pytest.mark.parametrize("k_scale", ["per_channel_block", "per_token"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("piece_dtype", [True, False])
def test_cpu_backend_prefill_equals_the_torch_path(k_scale: str, dtype: torch.dtype,
                                                   piece_dtype: bool) -> None:
    """The CPU backend with the kernel (pool writes and prefix reads, staged keys copied in
    after the pool keys) gives its outputs and pool bytes without it (torch ops) exactly."""
    kernel()
    out, pool = _attention_run(True, k_scale, dtype, piece_dtype)
    want, want_pool = _attention_run(False, k_scale, dtype, piece_dtype)
    assert torch.equal(out, want)
    for name, t in want_pool.items():
        assert torch.equal(pool[name], t), name
