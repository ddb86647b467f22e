"""The Triton paged prefill (slimkv.kernels.triton.prefill), run on CPU tensors by Triton's
interpreter, against the engine's oracle :func:`reference_paged_attention` on a real
:class:`PagedKVCache` (and :class:`Staging` for per-channel-block keys) written the engine's
way: earlier chunks cached the prefix, then the chunk's own K/V were written
(``cache.write``, or ``Staging.append``, whose :class:`StagedKV` the kernel reads).

Every pool block starts as junk (|x| ~ 30: a junk key leaked into a softmax dominates it),
so a read past the sequence, of a tail past ``seq_len``, of the staged cache's stale own
block in the pool, or of the padding of the block table fails the comparison by far.

Bounds, each against attention in float64 over the very context the reference reads
(``sequence_context`` dequantizes in float32, then casts: codes times float16 scales, plus
int4's zeros, are exact in float32, and the kernel's loader computes the same values), so
only the kernel's own arithmetic is measured:

* float32 queries: atol 3e-5 (rtol 0). The kernel's dots are IEEE float32; what differs
  from float64 is the float32 rounding of the scores (|s| up to ~15 here, D up to 128:
  the dot's summation order and the score's own rounding, ~1e-6 of s) carried into the
  output through ``|v - out|`` (up to ~10), and the online softmax's rescaling. Seen: at
  most 1.8e-5, the same as the float32 oracle's own error (2.0e-5); 3.4e-6 with tiles of
  <= 64 rows (numpy's matmul sums a 128-row tile less accurately under the interpreter).
  Against :func:`reference_paged_attention` itself (float32): atol 5e-5, that bound plus
  the oracle's own error (seen: 1.9e-5).
* float16 queries (16-bit dots, float32 accumulation, float16 output): against attention
  over K and V rounded to float16 (what the dots read), per element
  ``u * (sum_k p_k |v_k| + |out|) + 3e-5`` with u = 2^-11: the probabilities' rounding
  (relative u each, so at most ``u * sum p|v|``), the output's (at most ``u * |out|``)
  and the float32 floor above (seen: at most 0.68 of it). Against unrounded K, V: atol
  1.5e-2, K's rounding moving each score by up to ``u * scale * sum_d |q_d k_d|``
  (~0.01 here) times ``|v - out|`` on top (seen: 8.9e-3).

bfloat16 queries take the float16 path's code with another dtype, but the interpreter's
bfloat16 ``tl.dot`` is wrong (numpy has no bfloat16), so their test (the float16 bounds
with u = 2^-8; 1.5e-2 scaled by 8) runs on a GPU only: ``SLIMKV_TRITON_TEST_DEVICE=cuda``
runs this file's tests there, compiled (TRITON_INTERPRET unset).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# As in test_triton_kernels.py: Triton decides at import whether its jit functions are
# interpreted, so once imported without TRITON_INTERPRET=1 this file runs in a child.
# SLIMKV_TRITON_TEST_DEVICE=cuda runs the compiled kernels on a GPU instead (and the bf16 test).
# On a machine with CUDA the interpreted run goes to a child too, as in test_triton_kernels.py.
DEVICE = torch.device(os.environ.get("SLIMKV_TRITON_TEST_DEVICE", "cpu"))
IN_PROCESS = DEVICE.type != "cpu" or os.environ.get("TRITON_INTERPRET") == "1" or \
    ("triton" not in sys.modules and not torch.cuda.is_available())
if IN_PROCESS and DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from slimkv.attention.metadata import AttentionMetadata  # noqa: E402
from slimkv.attention.reference import reference_paged_attention, sequence_context  # noqa: E402
from slimkv.kernels.triton import side as fmt  # noqa: E402
from slimkv.kernels.triton.prefill import paged_prefill  # noqa: E402
from slimkv.kv.cache import PagedKVCache  # noqa: E402
from slimkv.kv.staging import Staging  # noqa: E402

BS, SLOT = 16, 2
FLOATS = [("float32", "float32", "per_token"), ("float16", "float16", "per_token"),
          ("bfloat16", "bfloat16", "per_token")]
PER_TOKEN = [("int8", "int8", "per_token"), ("fp8_e4m3", "fp8_e4m3", "per_token"),
             ("fp8_e5m2", "fp8_e5m2", "per_token"), ("int4", "int4", "per_token"),
             ("int8", "int4", "per_token")]
# Per-channel-block keys: a staged cache.
STAGED = [("int8", "int8", "per_channel_block"), ("fp8_e4m3", "fp8_e4m3", "per_channel_block"),
          ("fp8_e5m2", "int4", "per_channel_block"), ("int4", "int4", "per_channel_block"),
          ("int4", "int8", "per_channel_block")]
FORMATS = FLOATS + PER_TOKEN + STAGED
# (cached prefix, chunk length): a chunk starting the sequence, chunks after a prefix ending
# mid-block (one of a single token, one of 70 over five blocks), after a block edge.
CHUNKS = [(0, 37), (21, 45), (47, 1), (5, 70), (32, 17)]


def _sides(cache: PagedKVCache) -> list[fmt.TritonSide]:
    return [fmt.describe(cache.layer_codecs[0][s], cache.layer_pool(s, 0)) for s in "kv"]


def _check(formats, head_dim: int, start: int, n: int, group: int = 4, num_kv_heads: int = 1,
           block_size: int = BS, q_dtype: torch.dtype = torch.float32,
           staging_dtype: torch.dtype = torch.float32, **kw) -> float:
    """Cache ``[0, start)`` as earlier chunks did, write the chunk ``[start, start + n)``,
    then the kernel against the reference; returns the largest error."""
    k_dtype, v_dtype, k_scale = formats
    seq_len, heads = start + n, num_kv_heads * group
    gen = torch.Generator().manual_seed(1000 * start + 7 * n + head_dim + group)
    num_blocks = -(-seq_len // block_size) + 4
    cache = PagedKVCache(num_layers=1, num_blocks=num_blocks, block_size=block_size,
                         num_kv_heads=num_kv_heads, head_dim=head_dim, k_dtype=k_dtype,
                         v_dtype=v_dtype, k_scale=k_scale, device=DEVICE)
    staging = Staging(cache, SLOT + 1, staging_dtype) if cache.block_scaled else None
    junk = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen) * 30
    junk = junk.to(DEVICE)
    if staging is None:
        cache.write(0, torch.arange(num_blocks * block_size, device=DEVICE), *junk.flatten(1, 2))
    else:
        cache.write_blocks(0, torch.arange(num_blocks, device=DEVICE), *junk)
    # Shuffled, non-contiguous blocks (never 0), the table padded with block 0 as the engine's.
    table = (torch.randperm(num_blocks - 1, generator=gen) + 1)[:-(-seq_len // block_size)]
    table = torch.cat((table, torch.zeros(2, dtype=torch.long))).to(DEVICE)
    k, v = (torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(DEVICE) * 2
            for _ in "kv")
    q = (torch.randn(n, heads, head_dim, generator=gen) * 2).to(DEVICE, q_dtype)
    pos = torch.arange(seq_len, device=DEVICE)
    slots = table[pos // block_size] * block_size + pos % block_size
    staged = None
    # The prefix in two earlier chunks (the second one's start mid-block), then the chunk.
    cuts = [0, min(start, start // 2 + 3), start, seq_len]
    for a, b in zip(cuts, cuts[1:]):
        if a == b:
            continue
        if staging is None:
            cache.write(0, slots[a:b], k[a:b], v[a:b])
        else:
            staged = staging.append(0, SLOT, a, table[a // block_size:], k[a:b], v[a:b])
    meta = AttentionMetadata.build(block_size, [table.tolist()], [n], [seq_len], DEVICE,
                                   None if staging is None else [SLOT])
    staged_kv = None if staging is None else {0: staged}
    scale = head_dim ** -0.5
    expected = reference_paged_attention(cache, 0, q, meta, scale, torch.float32, staging,
                                         staged_kv)
    exact = _exact(cache, staging, meta, q, scale, staged=staged_kv)[0]
    out = paged_prefill(q, meta.block_tables[0], seq_len, *_sides(cache), staged, scale, **kw)
    assert out.dtype == q_dtype and out.shape == q.shape
    if q_dtype == torch.float32:
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=3e-5)
        torch.testing.assert_close(out, expected, rtol=0, atol=5e-5)
    else:
        u = torch.finfo(q_dtype).eps / 2  # unit roundoff, 2^-11 for float16, 2^-8 for bf16
        torch.testing.assert_close(out.double(), exact, rtol=0, atol=1.5e-2 * u / 2 ** -11)
        # Against attention over K, V rounded to q's dtype: P's and the output's rounding.
        rounded, spread = _exact(cache, staging, meta, q, scale, q_dtype, staged_kv)
        err = (out.double() - rounded).abs()
        bound = u * (spread + rounded.abs()) + 3e-5
        assert (err <= bound).all(), f"{(err - bound).max():.2e} past {bound.min():.2e}"
    return (out.double() - exact).abs().max().item()


def _exact(cache: PagedKVCache, staging: Staging | None, meta: AttentionMetadata, q, scale,
           rounded: torch.dtype | None = None, staged=None):
    """The reference's attention in float64 over the same context (``sequence_context``
    dequantizes in float32 and casts: the very values the float32 reference reads), K and V
    first rounded to ``rounded`` if given; and ``sum_k p_k |v_k|`` per output element."""
    k, v, mask = sequence_context(cache, staging, 0, meta, 0, torch.float64, staged)
    if rounded is not None:
        k, v = (x.to(rounded).double() for x in (k, v))
    group = q.shape[1] // cache.num_kv_heads
    k, v = (x[0].repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    probs = scores.masked_fill(~mask[0], float("-inf")).softmax(dim=-1)
    return (torch.einsum("hqk,khd->qhd", probs, v),
            torch.einsum("hqk,khd->qhd", probs, v.abs()))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("formats", FORMATS, ids="-".join)
def test_prefill_equals_reference(formats, head_dim: int) -> None:
    """Every format and scale layout; every chunk shape of CHUNKS; G = 4 (128-row tiles:
    the fewest programs under the interpreter; other tile sizes below)."""
    for start, n in CHUNKS:
        _check(formats, head_dim, start, n, block_rows=128)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("formats", [FLOATS[2], PER_TOKEN[0], PER_TOKEN[3], STAGED[1],
                                     STAGED[3]], ids="-".join)
def test_prefill_query_groups(formats, group: int) -> None:
    """G query heads per KV head folded into a tile's rows, over two KV heads; 32-row tiles,
    so (G = 3) tiles start and end mid-position and the chunk takes several."""
    _check(formats, 64, 21, 45, group, num_kv_heads=2, block_rows=32)


@pytest.mark.parametrize("block_rows", [16, 64])
@pytest.mark.parametrize("formats", [PER_TOKEN[1], STAGED[0]], ids="-".join)
def test_prefill_tile_rows(formats, block_rows: int) -> None:
    """Tiles from a fraction of a block's queries to several blocks' (staged: a tile's
    queries in several own blocks, loop 2 from the first one's)."""
    for start, n in [(3, 61), (50, 30)]:
        _check(formats, 64, start, n, group=3, block_rows=block_rows)


@pytest.mark.parametrize("block_size", [4, 32])
@pytest.mark.parametrize("formats", [PER_TOKEN[0], PER_TOKEN[3], STAGED[3]], ids="-".join)
def test_prefill_block_sizes(formats, block_size: int) -> None:
    """A block smaller than a 16-row tile (padded, masked) and one larger than 16."""
    for start, n in [(0, 23), (13, 40)]:
        _check(formats, 64, start, n, group=2, block_size=block_size)


@pytest.mark.parametrize("formats", [PER_TOKEN[3], STAGED[4]], ids="-".join)
def test_prefill_head_dim_not_a_power_of_two(formats) -> None:
    """head_dim 96 pads the tiles to 128 (int4: three groups of 32 per token)."""
    _check(formats, 96, 21, 45, group=2)


@pytest.mark.parametrize("formats", [STAGED[0], STAGED[3]], ids="-".join)
def test_prefill_reads_bfloat16_staging(formats) -> None:
    """A bf16 model's staged tokens, read at their own precision."""
    for start, n in [(21, 45), (0, 20)]:
        _check(formats, 64, start, n, group=2, staging_dtype=torch.bfloat16)


@pytest.mark.parametrize("formats", [FLOATS[1], PER_TOKEN[0], PER_TOKEN[3], STAGED[1]],
                         ids="-".join)
def test_prefill_float16_queries(formats) -> None:
    """16-bit dots (K, V, P rounded to float16, float32 accumulation), float16 output."""
    worst = max(_check(formats, 64, start, n, q_dtype=torch.float16)
                for start, n in [(21, 45), (0, 37)])
    print(f"largest float16 error {worst:.2e}")


@pytest.mark.skipif(DEVICE.type == "cpu", reason="the interpreter's bfloat16 tl.dot is wrong")
@pytest.mark.parametrize("formats", [FLOATS[2], PER_TOKEN[0], PER_TOKEN[3], STAGED[1]],
                         ids="-".join)
def test_prefill_bfloat16_queries(formats) -> None:
    """The float16 test's bounds with bfloat16's unit roundoff (2^-8): GPU only."""
    for start, n in [(21, 45), (0, 37)]:
        _check(formats, 64, start, n, q_dtype=torch.bfloat16, staging_dtype=torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("formats", [PER_TOKEN[0], STAGED[0], STAGED[3]], ids="-".join)
def test_prefill_long_context(formats) -> None:
    """A 300-token prefix (19 pool blocks) under a 130-token chunk, G = 4, D = 128."""
    _check(formats, 128, 300, 130, group=4, num_kv_heads=2)


def test_prefill_rejects_bad_arguments() -> None:
    cache = PagedKVCache(num_layers=1, num_blocks=4, block_size=BS, num_kv_heads=2,
                         head_dim=64, k_dtype="int8", v_dtype="int8",
                         k_scale="per_channel_block", device=DEVICE)
    q, table = torch.zeros(5, 4, 64, device=DEVICE), torch.arange(1, 3, device=DEVICE)
    with pytest.raises(ValueError, match="StagedKV"):
        paged_prefill(q, table, 20, *_sides(cache), None)
    staging = Staging(cache, 1, torch.float32)
    staged = staging.append(0, 0, 15, table, *torch.zeros(2, 5, 2, 64, device=DEVICE))
    with pytest.raises(ValueError, match="cover"):
        paged_prefill(q, table, 21, *_sides(cache), staged)
    with pytest.raises(ValueError, match="query heads"):
        paged_prefill(q[:, :3], table, 20, *_sides(cache), staged)
    with pytest.raises(ValueError, match="block ids"):
        paged_prefill(q, table[:1], 20, *_sides(cache), staged)


if not IN_PROCESS:
    for _name in [name for name in globals() if name.startswith("test_")]:
        del globals()[_name]

    def test_in_a_child_process() -> None:
        """All of the above, in a child that sets TRITON_INTERPRET=1 before importing triton."""
        result = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", __file__],
            cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True,
            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:]
        skips = [line for line in result.stdout.splitlines() if line.startswith("SKIPPED")]
        assert " passed" in result.stdout and all("bfloat16 tl.dot" in line for line in skips), \
            result.stdout[-500:]
