"""The fused decode kernel equals the gather-then-SDPA path and the reference, per format."""

from __future__ import annotations

import pytest
import torch

from slimkv.backends import cpu_decode as kernels
from slimkv.kernels import build
from slimkv.attention.layer import PagedAttention
from slimkv.backends import KERNELS
from slimkv.attention.metadata import AttentionMetadata
from slimkv.attention.reference import reference_paged_attention
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging

BLOCK_SIZE, NUM_KV_HEADS, NUM_HEADS = 16, 3, 9
# (k dtype, v dtype, k_scale): every KV format the kernel decodes, staged and not.
FORMATS = [("float32", "float32", "per_token"), ("bfloat16", "bfloat16", "per_token"),
           ("float16", "float16", "per_token"), ("int8", "int8", "per_token"),
           ("int8", "int8", "per_channel_block"), ("fp8_e4m3", "fp8_e4m3", "per_token"),
           ("fp8_e5m2", "fp8_e5m2", "per_channel_block"), ("int4", "int4", "per_token"),
           ("int4", "int4", "per_channel_block"), ("int8", "int4", "per_channel_block")]


def _decode_step(k_dtype: str, v_dtype: str, k_scale: str, head_dim: int, lens: list[int],
                 model_dtype: torch.dtype, layer: int = 0, layer_dtypes: dict | None = None,
                 heads: tuple[int, int] = (NUM_HEADS, NUM_KV_HEADS), int4_group_size: int = 32
                 ) -> tuple[PagedKVCache, Staging | None, tuple, AttentionMetadata]:
    """A cache (and its staging, for per-block scales) holding ``lens[i] - 1`` tokens of each
    sequence in ``layer`` (block tables shuffled and padded), and the step that decodes one
    more token for each. ``heads``: (query heads, KV heads); ``int4_group_size``:
    kv_cache.int4.group_size."""
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(head_dim + len(lens))
    num_blocks = sum(-(-n // BLOCK_SIZE) for n in lens) + 1
    cache = PagedKVCache(num_layers=layer + 1, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, k_dtype=k_dtype,
                         v_dtype=v_dtype, device=torch.device("cpu"), k_scale=k_scale,
                         layer_dtypes=layer_dtypes, int4_group_size=int4_group_size)
    staging = Staging(cache, len(lens), model_dtype) if cache.block_scaled else None
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    prefill = PagedAttention(cache, num_heads, head_dim ** -0.5, model_dtype, staging=staging,
                             kernels=KERNELS)
    for i, n in enumerate(lens):
        num = -(-n // BLOCK_SIZE)
        blocks, order = order[:num], order[num:]
        tables.append(blocks)
        if n == 1:
            continue
        meta = _meta([n - 1], [n - 1], [blocks], [i])
        q, k, v = (torch.randn(n - 1, h, head_dim, generator=gen, dtype=model_dtype) * 2
                   for h in (num_heads, num_kv_heads, num_kv_heads))
        prefill(layer, q, k, v, meta)
    meta = _meta([1] * len(lens), lens, tables, list(range(len(lens))))
    step = tuple(torch.randn(len(lens), h, head_dim, generator=gen, dtype=model_dtype) * 2
                 for h in (num_heads, num_kv_heads, num_kv_heads))
    return cache, staging, step, meta


def _meta(query_lens: list[int], seq_lens: list[int], tables: list[list[int]],
          slots: list[int]) -> AttentionMetadata:
    return AttentionMetadata.build(BLOCK_SIZE, tables, query_lens, seq_lens,
                                   torch.device("cpu"), slots)


def _decode(cache: PagedKVCache, staging: Staging | None, step: tuple, meta: AttentionMetadata,
            model_dtype: torch.dtype, kernel: bool,
            layer: int = 0) -> tuple[torch.Tensor, PagedAttention]:
    num_heads = step[0].shape[1]
    attn = PagedAttention(cache, num_heads, cache.head_dim ** -0.5, model_dtype, staging=staging,
                          backend=None if kernel else "sdpa", kernels=KERNELS)
    return attn(layer, *step, meta), attn


@pytest.mark.usefixtures("fused_kernel")
@pytest.mark.parametrize("head_dim", [64, 128, 32])
@pytest.mark.parametrize("k_dtype, v_dtype, k_scale", FORMATS)
def test_fused_decode_equals_sdpa_and_reference(k_dtype: str, v_dtype: str, k_scale: str,
                                                head_dim: int) -> None:
    lens = [1, 16, 17, 40, 100]  # a lone token, a block edge, block + 1, partial blocks
    cache, staging, step, meta = _decode_step(k_dtype, v_dtype, k_scale, head_dim, lens,
                                              torch.float32)
    state = {name: t.clone() for name, t in cache.tensors().items()}
    fused, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True)
    assert attn.path_counts == {"fused_decode": 1}
    for name, t in cache.tensors().items():  # rewind the step's write for the second run
        t.copy_(state[name])
    sdpa, other = _decode(cache, staging, step, meta, torch.float32, kernel=False)
    assert other.path_counts == {"fast_decode": 1}
    reference = reference_paged_attention(cache, 0, step[0], meta, head_dim ** -0.5,
                                          torch.float32, staging)
    torch.testing.assert_close(fused, sdpa, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
@pytest.mark.parametrize("group_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("k_dtype, v_dtype, k_scale", [f for f in FORMATS if "int4" in f[:2]])
def test_fused_decode_int4_group_sizes(k_dtype: str, v_dtype: str, k_scale: str, head_dim: int,
                                       group_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """kv_cache.int4.group_size: per-token int4 in groups of 16 or 64 (one scale and zero
    per token-head at head_dim 64), fused and portable kernels against SDPA and the
    reference, at the bounds of the group-32 test above."""
    lens = [1, 16, 17, 40, 100]
    cache, staging, step, meta = _decode_step(k_dtype, v_dtype, k_scale, head_dim, lens,
                                              torch.float32, int4_group_size=group_size)
    per_token = [c for c in cache.all_codecs() if c.aux_widths.get("scale")]
    assert per_token and all(c.aux_widths["scale"] == head_dim // group_size for c in per_token)
    state = {name: t.clone() for name, t in cache.tensors().items()}
    staged = None if staging is None else staging.buffer.clone()

    def rewind() -> None:  # the step's write undone for the next run
        for name, t in cache.tensors().items():
            t.copy_(state[name])
        if staging is not None:
            staging.buffer.copy_(staged)

    fused, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True)
    assert attn.path_counts == {"fused_decode": 1}
    rewind()
    sdpa, _ = _decode(cache, staging, step, meta, torch.float32, kernel=False)
    rewind()
    monkeypatch.setattr(kernels._KERNEL, "_loaded",
                        kernels.DecodeKernel(build.load(kernels.SOURCE), "paged_decode_portable"))
    portable, _ = _decode(cache, staging, step, meta, torch.float32, kernel=True)
    reference = reference_paged_attention(cache, 0, step[0], meta, head_dim ** -0.5,
                                          torch.float32, staging)
    torch.testing.assert_close(fused, sdpa, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(portable, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
@pytest.mark.parametrize("head_dim", [40, 72])
@pytest.mark.parametrize("k_dtype, v_dtype, k_scale",
                         [f for f in FORMATS if "int4" not in f[:2]])  # int4: head_dim % 32
def test_fused_decode_head_dims_of_eight_lanes(k_dtype: str, v_dtype: str, k_scale: str,
                                               head_dim: int) -> None:
    """Head dims that are multiples of 8, not 16 (the AVX2 path's; the portable loop's with
    AVX-512): 72 takes a 64-channel register chunk and an 8-channel one."""
    lens = [1, 17, 100]
    cache, staging, step, meta = _decode_step(k_dtype, v_dtype, k_scale, head_dim, lens,
                                              torch.float32)
    fused, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True)
    reference = reference_paged_attention(cache, 0, step[0], meta, head_dim ** -0.5,
                                          torch.float32, staging)
    assert attn.path_counts == {"fused_decode": 1}
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
@pytest.mark.parametrize("k_dtype, v_dtype, k_scale", [FORMATS[1], FORMATS[4], FORMATS[5],
                                                       FORMATS[8]])
def test_fused_decode_splits_a_long_sequence(k_dtype: str, v_dtype: str, k_scale: str) -> None:
    """A long sequence next to short ones is attended in parts by several threads
    (flash-decoding, parts merged by log-sum-exp) and still equals the reference."""
    lens = [2500, 3, 700]  # 157 blocks: split into parts of at most ~16 blocks
    cache, staging, step, meta = _decode_step(k_dtype, v_dtype, k_scale, 64, lens,
                                              torch.float32)
    fused, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True)
    reference = reference_paged_attention(cache, 0, step[0], meta, 64 ** -0.5, torch.float32,
                                          staging)
    assert attn.path_counts == {"fused_decode": 1}
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
@pytest.mark.parametrize("heads", [(8, 2), (6, 6), (16, 2), (4, 2)])  # G = 4, 1, 8, 2
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("k_dtype, v_dtype, k_scale",
                         [FORMATS[1], FORMATS[3], FORMATS[4], FORMATS[8], FORMATS[9]])
def test_fused_decode_query_groups_over_ragged_blocks(k_dtype: str, v_dtype: str, k_scale: str,
                                                      head_dim: int,
                                                      heads: tuple[int, int]) -> None:
    lens = [5, 31, 33, 250]  # last blocks of 5, 15, 1 and 10 tokens
    cache, staging, step, meta = _decode_step(k_dtype, v_dtype, k_scale, head_dim, lens,
                                              torch.float32, heads=heads)
    fused, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True)
    reference = reference_paged_attention(cache, 0, step[0], meta, head_dim ** -0.5,
                                          torch.float32, staging)
    assert attn.path_counts == {"fused_decode": 1}
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
@pytest.mark.parametrize("k_dtype, v_dtype, k_scale", FORMATS)
def test_portable_decode_loop_equals_reference(k_dtype: str, v_dtype: str, k_scale: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The portable loop (CPUs without AVX-512 or AVX2, other head dims) on this CPU too."""
    lib = build.load(kernels.SOURCE)
    monkeypatch.setattr(kernels._KERNEL, "_loaded",
                        kernels.DecodeKernel(lib, "paged_decode_portable"))
    cache, staging, step, meta = _decode_step(k_dtype, v_dtype, k_scale, 64, [1, 17, 100],
                                              torch.float32)
    fused, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True)
    reference = reference_paged_attention(cache, 0, step[0], meta, 64 ** -0.5, torch.float32,
                                          staging)
    assert attn.path_counts == {"fused_decode": 1}
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
def test_fused_decode_in_bfloat16_model_dtype() -> None:
    cache, staging, step, meta = _decode_step("int8", "int8", "per_channel_block", 64, [5, 33],
                                              torch.bfloat16)
    fused, attn = _decode(cache, staging, step, meta, torch.bfloat16, kernel=True)
    reference = reference_paged_attention(cache, 0, step[0], meta, 64 ** -0.5, torch.bfloat16,
                                          staging)
    assert attn.path_counts == {"fused_decode": 1} and fused.dtype == torch.bfloat16
    torch.testing.assert_close(fused.float(), reference.float(), rtol=0, atol=2e-2)


@pytest.mark.usefixtures("fused_kernel")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("k_dtype, v_dtype, k_scale", [f for f in FORMATS if f[2] != "per_token"])
def test_fused_decode_reads_bfloat16_staging_as_the_portable_loop(
        k_dtype: str, v_dtype: str, k_scale: str, head_dim: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 model's staged own blocks (1 to 16 rows: lens 5, 16, 33, 47) converted in vectors
    by the AVX-512 path, int4 sides de-interleaved: the float32 result of the portable loop,
    which converts row by row."""
    captured = []
    lib = build.load(kernels.SOURCE)
    for name in ("paged_decode", "paged_decode_portable"):
        kernel = kernels.DecodeKernel(lib, name)

        def spy(*args, kernel=kernel):  # the float32 result, before the cast to bf16
            captured.append(kernel(*args))
            return captured[-1]

        monkeypatch.setattr(kernels._KERNEL, "_loaded", spy)
        cache, staging, step, meta = _decode_step(k_dtype, v_dtype, k_scale, head_dim,
                                                  [5, 16, 33, 47], torch.bfloat16)
        _, attn = _decode(cache, staging, step, meta, torch.bfloat16, kernel=True)
        assert attn.path_counts == {"fused_decode": 1} and staging is not None
    native, portable = captured
    torch.testing.assert_close(native, portable, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
def test_fused_decode_reads_each_layer_with_its_own_codec() -> None:
    """kv_cache.layer_dtypes: layer 1 stored in int4 while the default is int8."""
    cache, staging, step, meta = _decode_step("int8", "int8", "per_channel_block", 64, [7, 40],
                                              torch.float32, layer=1,
                                              layer_dtypes={"int4": [1]})
    assert cache.layer_codecs[1]["k"].name == "int4"
    fused, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True, layer=1)
    reference = reference_paged_attention(cache, 1, step[0], meta, 64 ** -0.5, torch.float32,
                                          staging)
    assert attn.path_counts == {"fused_decode": 1}
    torch.testing.assert_close(fused, reference, rtol=1e-5, atol=1e-5)


def test_without_a_compiler_decodes_on_sdpa_and_says_why(monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path) -> None:
    monkeypatch.setenv("CC", "no-such-compiler")
    monkeypatch.setenv("PATH", str(tmp_path))
    kernels._KERNEL.reset()
    build.load.cache_clear()  # the shared builder caches each library (or why there is none)
    try:
        cache, staging, step, meta = _decode_step("int8", "int8", "per_token", 64, [20],
                                                  torch.float32)
        out, attn = _decode(cache, staging, step, meta, torch.float32, kernel=True)
        assert "no C compiler" in attn.backend.kernel_unavailable
        assert attn.path_counts == {"fast_decode": 1} and out.isfinite().all()
    finally:
        kernels._KERNEL.reset()
        build.load.cache_clear()


def test_kernel_tests_skip_without_a_compiler(tmp_path) -> None:
    """Where no C compiler exists the engine decodes on SDPA; the kernel tests say so and
    skip instead of failing (run in a child with no compiler on its PATH)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "CC": "no-such-compiler", "PATH": str(tmp_path),
           "SLIMKV_KERNEL_DIR": str(tmp_path / "kernels")}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__,
         "-k", "bfloat16_model_dtype or own_codec or equals_sdpa_and_reference and int8-int8"],
        cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
        timeout=300)
    assert result.returncode == 0, result.stdout[-3000:]
    assert " skipped" in result.stdout and " passed" not in result.stdout, result.stdout[-500:]
