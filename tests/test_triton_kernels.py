"""The Triton decode and pool-write kernels (slimkv.kernels.triton), run on CPU tensors by
Triton's interpreter, against the reference attention and the codecs.

Bounds. Decode: rtol = atol = 1e-5 against the float32 reference for every format. Both
sides dequantize to the same float32 values (a code times a float16 scale is exact in
float32, plus the same int4 zero add), so what differs is float32 arithmetic only: the
order of the dot-product and softmax sums, the online softmax's rescaling, split merging
and exp; that is a few ulp of the scores (|s| up to ~15 here) carried into the output
(~5e-6 at most seen), the bound the C kernel's tests use too. Writes: exact (codes, scales
and zeros equal the codecs' bit for bit).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# Triton decides at import whether its own jit functions (tl.max, tl.sum...) are
# interpreted: once imported without TRITON_INTERPRET=1 (torch._dynamo imports it, e.g. in a
# whole-suite run), this file runs in a child process instead (see the end). So it does on a
# machine with CUDA: setting the variable here would send the compiled CUDA tests of the same
# run (tests/test_cuda.py) to the interpreter too.
IN_PROCESS = os.environ.get("TRITON_INTERPRET") == "1" or \
    ("triton" not in sys.modules and not torch.cuda.is_available())
if IN_PROCESS:
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from slimkv.attention.metadata import AttentionMetadata  # noqa: E402
from slimkv.attention.reference import reference_paged_attention  # noqa: E402
from slimkv.kernels import kernel_format  # noqa: E402
from slimkv.kernels.triton import decode, write  # noqa: E402
from slimkv.kernels.triton import side as fmt, triton_unavailable_reason  # noqa: E402
from slimkv.kv.cache import PagedKVCache  # noqa: E402
from slimkv.kv.quant import Fp8Codec, Int8Codec  # noqa: E402
from slimkv.kv.staging import Staging  # noqa: E402

BS, CPU = 16, torch.device("cpu")
FLOATS = [("float16", "float16", "per_token"), ("bfloat16", "bfloat16", "per_token")]
PER_TOKEN = [("int8", "int8", "per_token"), ("fp8_e4m3", "fp8_e4m3", "per_token"),
             ("fp8_e5m2", "fp8_e5m2", "per_token"), ("int4", "int4", "per_token")]
# Per-channel-block keys: a staged cache (the last block at full precision).
STAGED = [("int8", "int8", "per_channel_block"), ("fp8_e4m3", "fp8_e4m3", "per_channel_block"),
          ("fp8_e5m2", "int4", "per_channel_block"), ("int4", "int4", "per_channel_block"),
          ("int4", "int8", "per_channel_block")]
FORMATS = FLOATS + PER_TOKEN + STAGED
LENS = [1, 16, 17, 45, 100]  # a lone token, a block edge, block + 1, ragged, 7 blocks


def _sides(cache: PagedKVCache, layer: int = 0) -> list[fmt.TritonSide]:
    return [fmt.describe(cache.layer_codecs[layer][s], cache.layer_pool(s, layer)) for s in "kv"]


def _cache(formats: tuple[str, str, str], head_dim: int, lens: list[int], num_kv_heads: int,
           staging_dtype: torch.dtype = torch.float32, seed: int = 0, group_size: int = 32):
    """A cache (and staging, for per-block scales) holding ``lens[i]`` tokens of sequence i
    in random, non-contiguous blocks (tables padded), and its decode metadata;
    ``group_size``: kv_cache.int4.group_size."""
    k_dtype, v_dtype, k_scale = formats
    gen = torch.Generator().manual_seed(seed + head_dim)
    num_blocks = 2 * sum(-(-n // BS) for n in lens) + 1
    cache = PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=BS,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, k_dtype=k_dtype,
                         v_dtype=v_dtype, k_scale=k_scale, device=CPU,
                         int4_group_size=group_size)
    staging = Staging(cache, len(lens), staging_dtype) if cache.block_scaled else None
    order = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = []
    for i, n in enumerate(lens):
        blocks, order = order[:-(-n // BS)], order[-(-n // BS):]
        tables.append(blocks)
        k, v = (torch.randn(n, num_kv_heads, head_dim, generator=gen) * 2 for _ in "kv")
        if staging is None:
            cache.write(0, torch.tensor([blocks[p // BS] * BS + p % BS for p in range(n)]), k, v)
        else:
            staging.append(0, i, 0, torch.tensor(blocks), k, v)
    meta = AttentionMetadata.build(BS, tables, [1] * len(lens), lens, CPU, list(range(len(lens))))
    return cache, staging, meta, gen


def _check_decode(formats, head_dim: int, lens: list[int], group: int, num_kv_heads: int = 1,
                  staging_dtype: torch.dtype = torch.float32, group_size: int = 32,
                  **split) -> None:
    cache, staging, meta, gen = _cache(formats, head_dim, lens, num_kv_heads, staging_dtype,
                                       group_size=group_size)
    q = torch.randn(len(lens), num_kv_heads * group, head_dim, generator=gen) * 2
    scale = head_dim ** -0.5
    expected = reference_paged_attention(cache, 0, q, meta, scale, torch.float32, staging)
    staged = None if staging is None else (*staging.layer_buffers(0), meta.staging_slots)
    out = decode.TritonDecode(**split)(q, meta.block_tables, meta.seq_lens_t, *_sides(cache),
                                       num_kv_heads, BS, scale, staged)
    assert out.dtype == torch.float32 and out.shape == q.shape
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("formats", FORMATS, ids="-".join)
def test_decode_equals_reference(formats, head_dim: int) -> None:
    """Every format, ragged tables; 2 blocks per split: the 100-token sequence in 4 splits."""
    _check_decode(formats, head_dim, LENS, group=4, blocks_per_split=2)


@pytest.mark.parametrize("group_size", [16, 64])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("formats", [PER_TOKEN[3], STAGED[2], STAGED[3]], ids="-".join)
def test_decode_int4_group_sizes(formats, head_dim: int, group_size: int) -> None:
    """kv_cache.int4.group_size 16 and 64 (one scale and zero per token-head at 64)."""
    _check_decode(formats, head_dim, LENS, 3, 2, group_size=group_size)


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("formats", [FLOATS[1], PER_TOKEN[0], PER_TOKEN[3], STAGED[1]],
                         ids="-".join)
def test_decode_query_groups(formats, group: int) -> None:
    """G query heads per KV head read each KV row once (G = 3: padded to the tile), over
    two KV heads."""
    _check_decode(formats, 64, [5, 33, 70], group, num_kv_heads=2, blocks_per_split=2)


@pytest.mark.parametrize("split, num_splits", [
    ({"blocks_per_split": 1}, 19), ({"blocks_per_split": 3}, 7),
    ({"min_split_tokens": 16, "target_programs": 24}, 5), ({}, 2), ({"blocks_per_split": 19}, 1)],
    ids=["1", "3", "auto", "default", "one-split"])
@pytest.mark.parametrize("formats", [PER_TOKEN[1], STAGED[0]], ids="-".join)
def test_decode_split_boundaries(formats, split: dict, num_splits: int) -> None:
    """Split edges anywhere in a sequence, the staged block alone in its split, empty
    splits of short sequences; and the one-split path (no merge). 300 tokens: 19 blocks."""
    per = decode.TritonDecode(**split).split(4, 1, 19, BS)
    assert -(-19 // per) == num_splits
    _check_decode(formats, 64, [300, 5, 129, 48], 2, **split)


@pytest.mark.parametrize("formats", [PER_TOKEN[0], PER_TOKEN[3], STAGED[3]], ids="-".join)
def test_decode_head_dim_not_a_power_of_two(formats) -> None:
    """head_dim 96 pads the tiles to 128 (int4: three groups of 32 per token)."""
    _check_decode(formats, 96, [7, 40], 2, blocks_per_split=1)


@pytest.mark.parametrize("formats", [STAGED[0], STAGED[3]], ids="-".join)
def test_decode_reads_bfloat16_staging(formats) -> None:
    """A bf16 model's staging slots, read at their own precision."""
    _check_decode(formats, 64, [5, 16, 33], 2, staging_dtype=torch.bfloat16, blocks_per_split=1)


def _pools_equal(a: PagedKVCache, b: PagedKVCache) -> None:
    for name, x in a.tensors().items():
        y = b.tensors()[name]
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name


def _rows(gen: torch.Generator, n: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """Values across six decades (outlier channels), a zero row and one of tiny values
    (scales clamped to float16's smallest normal)."""
    x = torch.randn(n, num_kv_heads, head_dim, generator=gen) * torch.logspace(-3, 3, head_dim)
    x[0, 0], x[1, -1] = 0.0, 1e-9
    return x.to(dtype)


@pytest.mark.parametrize("model_dtype, head_dim", [(torch.float32, 64), (torch.float32, 128),
                                                   (torch.bfloat16, 64), (torch.float16, 128)])
@pytest.mark.parametrize("formats", [("float16", "bfloat16"), ("float32", "fp8_e4m3"),
                                     ("int8", "int8"), ("fp8_e4m3", "fp8_e5m2"),
                                     ("int4", "int4"), ("int8", "int4")], ids="-".join)
def test_write_tokens_equals_cache_write(formats, head_dim: int,
                                         model_dtype: torch.dtype) -> None:
    """Codes, scales and zeros bit for bit, at random slots; K a strided view."""
    caches = [PagedKVCache(num_layers=1, num_blocks=6, block_size=BS, num_kv_heads=3,
                           head_dim=head_dim, k_dtype=formats[0], v_dtype=formats[1],
                           k_scale="per_token", device=CPU) for _ in range(2)]
    gen = torch.Generator().manual_seed(head_dim)
    k = _rows(gen, 12, 4, head_dim, model_dtype)[:, 1:]  # strided: heads 1..3 of 4
    v = _rows(gen, 12, 3, head_dim, model_dtype) * 7
    slots = torch.randperm(6 * BS, generator=gen)[:12]
    caches[0].write(0, slots, k, v)
    write.write_tokens(*_sides(caches[1]), k, v, slots)
    _pools_equal(*caches)


@pytest.mark.parametrize("group_size", [16, 64])
def test_write_tokens_int4_group_sizes(group_size: int) -> None:
    """Per-token int4 codes, scales and zeros in groups of 16 / 64, bit for bit."""
    caches = [PagedKVCache(num_layers=1, num_blocks=6, block_size=BS, num_kv_heads=3,
                           head_dim=64, k_dtype="int4", v_dtype="int4", k_scale="per_token",
                           device=CPU, int4_group_size=group_size) for _ in range(2)]
    gen = torch.Generator().manual_seed(group_size)
    k, v = (_rows(gen, 12, 3, 64, torch.float32) * s for s in (1, 7))
    slots = torch.randperm(6 * BS, generator=gen)[:12]
    caches[0].write(0, slots, k, v)
    write.write_tokens(*_sides(caches[1]), k, v, slots)
    _pools_equal(*caches)


@pytest.mark.parametrize("staging_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("formats", STAGED, ids="-".join)
def test_store_blocks_equals_store_filled(formats, staging_dtype: torch.dtype) -> None:
    """Filled staged blocks: keys per channel over the block, values per token."""
    caches = [PagedKVCache(num_layers=1, num_blocks=8, block_size=BS, num_kv_heads=2,
                           head_dim=64, k_dtype=formats[0], v_dtype=formats[1],
                           k_scale=formats[2], device=CPU) for _ in range(2)]
    stagings = [Staging(c, 4, staging_dtype) for c in caches]
    gen = torch.Generator().manual_seed(1)
    x = torch.stack([_rows(gen, 4 * BS, 2, 64, torch.float32).unflatten(0, (4, BS))
                     for _ in "kv"])
    for staging in stagings:
        staging.buffer[:, 0] = x
    slots, block_ids, filled = torch.tensor([3, 0, 1, 2]), torch.tensor([5, 1, 7, 2]), \
        torch.tensor([0, 2, 3])
    stagings[0].store_filled(0, slots, block_ids, filled)
    write.store_blocks(*_sides(caches[1]), *stagings[1].layer_buffers(0), slots[filled],
                       block_ids[filled])
    _pools_equal(*caches)


@triton.jit
def _codes_kernel(y, out, N: tl.constexpr, KIND: tl.constexpr):
    at = tl.arange(0, N)
    tl.store(out + at, write._codes8(tl.load(y + at), KIND).to(tl.int32) & 0xFF)


@pytest.mark.parametrize("codec", [Int8Codec("int8", 1), Fp8Codec("fp8_e4m3", 1),
                                   Fp8Codec("fp8_e5m2", 1)], ids=lambda c: c.name)
def test_codes_round_half_to_even_as_torch(codec) -> None:
    """Every finite code's value, the midpoints between neighbours (ties) and one float32
    ulp either side, subnormals, signed zeros and values past the clamp."""
    if isinstance(codec, Int8Codec):
        grid = torch.arange(-130.0, 131.0)
    else:
        grid = torch.arange(256, dtype=torch.uint8).view(codec.fp8_dtype).float()
        grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2
    y = torch.cat([grid, mids, mids.nextafter(mids + 1), mids.nextafter(mids - 1),
                   torch.tensor([0.49999997, -0.0, 1e-30, -1e-30, 2 * codec.qmax])])
    y = torch.cat([y, -y])
    n = triton.next_power_of_2(len(y))
    y = torch.cat([y, torch.zeros(n - len(y))])
    out = torch.empty(n, dtype=torch.int32)
    kind = fmt.I8 if isinstance(codec, Int8Codec) else kernel_format(codec)[0]
    _codes_kernel[(1,)](y, out, N=n, KIND=kind)
    expected = codec._encode(y).view(torch.uint8).to(torch.int32)
    assert torch.equal(out, expected), y[out != expected][:8]


def test_unavailable_reason_under_the_interpreter() -> None:
    assert triton_unavailable_reason("cpu") is None
    assert "CPU tensors only" in triton_unavailable_reason("cuda")


if not IN_PROCESS:
    for _name in [name for name in globals() if name.startswith("test_")]:
        del globals()[_name]

    def test_in_a_child_process() -> None:
        """All of the above, in a child that sets TRITON_INTERPRET=1 before importing triton."""
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:]
        assert " passed" in result.stdout and " skipped" not in result.stdout, result.stdout[-500:]
