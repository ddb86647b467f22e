"""Scale layouts: per-channel key scales per block, the staging block and its hand-over,
chunking invariance and fast == reference on a staged cache, prefix hits on quantized blocks,
and exact byte accounting."""

from __future__ import annotations

import math

import pytest
import torch

from slimkv.attention.layer import PagedAttention
from slimkv.backends import KERNELS
from slimkv.attention.metadata import AttentionMetadata
from slimkv.kv.block_scales import ChannelBlockInt4Codec, per_channel_block
from slimkv.kv.cache import PagedKVCache, side_codec
from slimkv.kv.quant import Int4Codec, make_codec
from slimkv.kv.staging import Staging

HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, SLOTS = 4, 2, 32, 4, 32, 3
SCALE = 1 / math.sqrt(HEAD_DIM)
SCHEMES = [("int8", "per_channel_block"), ("fp8", "per_channel_block"),
           ("int4", "per_channel_block")]


def _keys(blocks: int = 3, seed: int = 0) -> torch.Tensor:
    """Blocks ``[n, BLOCK, H, D]`` of keys with outlier channels, as after RoPE."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    return x * torch.where(torch.arange(HEAD_DIM) % 7 == 0, 20.0, 1.0)


def _round_trip(name: str) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x = _keys()
    codec = per_channel_block(make_codec(name, HEAD_DIM))
    q = codec.quantize(x)
    return x, codec.dequantize(q, torch.float32), q.aux


def test_int8_per_channel_block_error_is_half_a_step_per_channel() -> None:
    x, y, aux = _round_trip("int8")
    step = aux["scale"].float().unsqueeze(-3)
    assert aux["scale"].shape == (3, KV_HEADS, HEAD_DIM)
    assert ((x - y).abs() <= step / 2 * (1 + 1e-3)).all()


def test_fp8_per_channel_block_error_within_e4m3_rounding() -> None:
    x, y, aux = _round_trip("fp8")
    scale = aux["scale"].float().unsqueeze(-3)
    # e4m3: 3 mantissa bits (relative half-ulp 2**-4); subnormal step 2**-9 in scaled units.
    bound = torch.maximum(x.abs() * 2**-4, scale * 2**-10) * (1 + 1e-3)
    assert ((x - y).abs() <= bound).all()


def test_int4_per_channel_block_error_is_half_a_step_per_channel() -> None:
    x, y, aux = _round_trip("int4")
    step = aux["scale"].float().unsqueeze(-3)
    assert aux["zero"].shape == (3, KV_HEADS, HEAD_DIM)
    assert ((x - y).abs() <= step / 2 * (1 + 1e-3)).all()


def test_per_channel_beats_per_token_on_outlier_channels() -> None:
    x = _keys()
    for name in ("int8", "int4"):
        per_token = side_codec(name, HEAD_DIM, "per_token")
        channel = side_codec(name, HEAD_DIM, "per_channel_block")
        err_token = (per_token.dequantize(per_token.quantize(x), torch.float32) - x).abs().mean()
        err_channel = (channel.dequantize(channel.quantize(x), torch.float32) - x).abs().mean()
        assert err_channel < err_token, name


def test_packed_int4_layout_per_channel_block() -> None:
    """Channel ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high nibble."""
    codec = per_channel_block(make_codec("int4", HEAD_DIM))
    assert isinstance(codec, ChannelBlockInt4Codec) and codec.data_width == HEAD_DIM // 2
    x = _keys(1)
    q = codec.quantize(x)
    assert q.data.dtype == torch.uint8 and q.data.shape == (1, BLOCK, KV_HEADS, HEAD_DIM // 2)
    levels = ((x - q.aux["zero"].float()) / q.aux["scale"].float()).round().clamp(0, 15)
    assert torch.equal((q.data & 0xF).float(), levels[..., 0::2])
    assert torch.equal((q.data >> 4).float(), levels[..., 1::2])
    assert torch.equal(Int4Codec.unpack(q.data).float(), levels)


def _cache(k_dtype: str, k_scale: str) -> PagedKVCache:
    return PagedKVCache(num_layers=2, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, k_dtype=k_dtype,
                        v_dtype=k_dtype, device=torch.device("cpu"), k_scale=k_scale)


def _staged(k_dtype: str, k_scale: str) -> tuple[PagedKVCache, Staging]:
    cache = _cache(k_dtype, k_scale)
    return cache, Staging(cache, SLOTS, torch.float32)


@pytest.mark.parametrize("name,k_scale", SCHEMES)
def test_staging_hands_over_at_exactly_block_size_tokens(name: str, k_scale: str) -> None:
    cache, staging = _staged(name, k_scale)
    x = _keys(1)[0]
    before = cache.tensors()["k_data"][1, 5].clone()
    blocks = torch.tensor([5])
    for t in range(BLOCK - 1):
        staging.append(1, 2, t, blocks, x[t:t + 1], -x[t:t + 1])
        assert torch.equal(cache.tensors()["k_data"][1, 5], before)  # still staged only
    staging.append(1, 2, BLOCK - 1, blocks, x[-1:], -x[-1:])
    expected = cache.codecs["k"].quantize(x[None])
    assert torch.equal(cache.tensors()["k_data"][1, 5], expected.data[0])
    for aux, t in expected.aux.items():
        assert torch.equal(cache.tensors()[f"k_{aux}"][1, 5], t[0])
    k, v = cache.read(1, blocks, torch.float32)
    assert torch.equal(k, cache.codecs["k"].dequantize(expected, torch.float32)[0])
    own_k, own_v = staging.blocks(1, torch.tensor([2]), torch.float32)
    assert torch.equal(own_k[0], x) and torch.equal(own_v[0], -x)  # the full block stays staged


def test_staged_cache_refuses_token_writes() -> None:
    with pytest.raises(RuntimeError):
        _cache("int8", "per_channel_block").write(0, torch.arange(2),
                                                               *_keys(1)[0, :2].repeat(2, 1, 1, 1))


def _run(name: str, lengths: list[int], schedule: list[list[int]], fast: bool = True,
         backend: str | None = None) -> torch.Tensor:
    """Attention outputs ``[sum(lengths), HEADS, D]`` of sequences fed in steps: step ``j``
    gives sequence ``i`` ``schedule[i][j]`` tokens (all sequences in one batch per step)."""
    gen = torch.Generator().manual_seed(1)
    cache, staging = _staged(name, "per_channel_block")
    attn = PagedAttention(cache, HEADS, SCALE, torch.float32, staging=staging,
                          backend=backend or (None if fast else "reference"), kernels=KERNELS)
    qkv = [[torch.randn(n, h, HEAD_DIM, generator=gen) * 3 for h in (HEADS, KV_HEADS, KV_HEADS)]
           for n in lengths]
    blocks = [list(range(1 + 8 * i, 9 + 8 * i)) for i in range(len(lengths))]  # padded tables
    done, outs = [0] * len(lengths), [[] for _ in lengths]
    for j in range(max(len(s) for s in schedule)):
        step = [(i, s[j]) for i, s in enumerate(schedule) if j < len(s)]
        lens = [n for _, n in step]
        seq_lens = [done[i] + n for i, n in step]
        meta = AttentionMetadata.build(BLOCK, [blocks[i] for i, _ in step], lens, seq_lens,
                                       torch.device("cpu"), [i for i, _ in step])
        q, k, v = (torch.cat([qkv[i][f][done[i]:done[i] + n] for i, n in step]) for f in range(3))
        out = attn(1, q, k, v, meta)
        for (i, n), rows in zip(step, out.split(lens)):
            outs[i].append(rows)
            done[i] += n
    return torch.cat([torch.cat(o) for o in outs])


@pytest.mark.parametrize("name", ["int8", "int4"])
def test_staged_chunking_invariance_and_fast_equals_reference(name: str) -> None:
    lengths = [13, 8, 6]
    whole = _run(name, lengths, [[13], [8], [6]], fast=True)
    chunked = _run(name, lengths, [[3, 5, 1, 1, 3], [4, 1, 1, 1, 1], [1] * 6], fast=True)
    reference = _run(name, lengths, [[3, 5, 1, 1, 3], [4, 1, 1, 1, 1], [1] * 6], fast=False)
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(reference, chunked, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "sdpa", "triton"])
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_every_backend_equals_the_reference_on_a_staged_cache(name: str, backend: str) -> None:
    """Each backend on its own (chosen by name), prefill chunks and decodes mixed in steps,
    against the reference backend fed the same steps."""
    _skip_unavailable(backend)
    schedule = [[3, 5, 1, 1, 3], [4, 1, 1, 1, 1], [1] * 6]
    out = _run(name, [13, 8, 6], schedule, backend=backend)
    torch.testing.assert_close(out, _run(name, [13, 8, 6], schedule, fast=False),
                               rtol=1e-5, atol=1e-5)


def _skip_unavailable(backend: str) -> None:
    from slimkv.backends.cpu_decode import kernel_unavailable_reason

    if backend == "cpu" and kernel_unavailable_reason() is not None:
        pytest.skip(kernel_unavailable_reason())
    if backend == "triton":
        pytest.importorskip("triton")


@pytest.mark.parametrize("name,k_scale", SCHEMES)
def test_bytes_match_allocation(name: str, k_scale: str) -> None:
    cache, staging = _staged(name, k_scale)
    shape = dict(num_layers=2, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, k_dtype=name,
                 v_dtype=name, k_scale=k_scale)
    assert cache.nbytes == NUM_BLOCKS * PagedKVCache.block_bytes(**shape, block_size=BLOCK)
    assert staging.nbytes == Staging.bytes(2, KV_HEADS, HEAD_DIM, BLOCK, SLOTS, torch.float32)
    assert PagedKVCache.num_blocks_for_budget(
        cache.nbytes + staging.nbytes, staging.nbytes, **shape, block_size=BLOCK) == NUM_BLOCKS


def test_planner_accounts_for_block_scales_and_staging() -> None:
    from slimkv.planner import plan

    p = plan("llama-3.1-8b", 80 * 2**30, context=32768, sessions=48, kv_dtypes=("int8",),
             k_scale="per_channel_block")
    [row] = p.rows
    # 32 layers x 8 KV heads; K: 128 int8 + 128 float16 scales per 16-token block-head;
    # V: 128 int8 + one float16 scale per token-head.
    assert row.bytes_per_token == 32 * 8 * (128 + 128 * 2 // 16 + 128 + 2)
    staging = Staging.bytes(32, 8, 128, 16, 48 + 1, torch.bfloat16)
    assert row.num_blocks == (p.kv_budget - staging) // (16 * row.bytes_per_token)


@pytest.mark.slow
def test_prefix_hits_on_quantized_blocks_equal_cold_prefill() -> None:
    """The second request reuses the first one's full (quantized) blocks; its logits and
    greedy tokens equal a cold prefill of the same prompt on a fresh engine."""
    from slimkv.config import Config
    from slimkv.engine.llm_engine import LLMEngine
    from slimkv.plugins import build_engine
    from slimkv.engine.sampling import SamplingParams

    config = Config.load().replace("model", device="cpu", dtype="float32").replace(
        "kv_cache", k_scale="per_channel_block", num_blocks=64)
    prompt = list(range(1000, 1045))
    params = SamplingParams(max_tokens=4, temperature=0.0)

    def generate(engine: LLMEngine) -> list[int]:
        seq = engine.add_request(prompt, params)
        while engine.has_unfinished():
            engine.step()
        return seq.output_token_ids

    warm = build_engine(config)
    generate(warm)
    hit = warm.add_request(list(prompt), params)
    while warm.has_unfinished():
        warm.step()
    assert hit.num_cached_tokens == 32  # two full quantized blocks
    cold = generate(build_engine(config))
    assert hit.output_token_ids == cold
    assert warm.memory_split()["kv_staging"] == warm.runner.staging.nbytes > 0


@pytest.mark.slow
def test_harness_quick_suite_per_channel_block_bounds() -> None:
    """The quick suite's corpus windows against float32 KV: int8 with per-channel key
    scales within 0.05% perplexity and >= 99% top-1; int4 with them loses at least 3x less
    perplexity than int4 in groups of 32."""
    import dataclasses

    from slimkv.config import Config
    from slimkv.eval.harness import SUITES, run_eval
    from slimkv.eval.report import metrics, regressions

    # The quick suite's perplexity windows only (no passkey depths, no recall probes).
    suite = dataclasses.replace(SUITES["quick"], depths=(), document_contexts=(),
                                conversation_contexts=())
    ev = run_eval(Config.load().replace("model", device="cpu", dtype="float32"),
                  ["int8:per_channel_block", "int4:per_token", "int4:per_channel_block"], suite,
                  progress=False)
    runs = {run.dtype: run for run in ev.runs}
    int8 = runs["int8:per_channel_block"]
    assert abs(regressions(int8, ev)["perplexity"]) <= 0.05
    assert metrics(int8, ev)["top1_agreement"] >= 99
    loss_group = regressions(runs["int4:per_token"], ev)["perplexity"]
    loss_channel = regressions(runs["int4:per_channel_block"], ev)["perplexity"]
    assert loss_group > 0 and loss_channel * 3 <= loss_group


def _quantized(x: torch.Tensor, reduce: int) -> torch.Tensor:
    """Symmetric int8 round trip with a float16 absmax scale over dim ``reduce``."""
    scale = (x.abs().amax(reduce, keepdim=True) / 127).half().float()
    return (x / scale).round().clamp(-127, 127) * scale


@pytest.mark.parametrize("fast", [True, False])
def test_staged_prefill_equals_an_independent_float_computation(fast: bool) -> None:
    """One 11-token prefill into blocks [5, 2, 7] of an int8 cache with per-channel key
    scales. By hand: a query at position p sees the keys and values of the blocks before
    its own quantized (keys per channel over each full block, values per token) and its
    own block's up to p at full precision, in plain float32 attention."""
    n, group = 11, HEADS // KV_HEADS
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(n, HEADS, HEAD_DIM, generator=gen)
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) * 3 for _ in range(2))
    cache, staging = _staged("int8", "per_channel_block")
    attn = PagedAttention(cache, HEADS, SCALE, torch.float32, staging=staging,
                          backend=None if fast else "reference", kernels=KERNELS)
    meta = AttentionMetadata.build(BLOCK, [[5, 2, 7]], [n], [n], torch.device("cpu"), [0])
    out = attn(0, q, k, v, meta)

    full = n // BLOCK * BLOCK
    k_pool = _quantized(k[:full].unflatten(0, (-1, BLOCK)), 1).flatten(0, 1)
    v_pool = _quantized(v[:full], -1)
    expected = torch.empty_like(q)
    for p in range(n):
        own = p // BLOCK * BLOCK
        keys = torch.cat((k_pool[:own], k[own:p + 1]))
        values = torch.cat((v_pool[:own], v[own:p + 1]))
        for h in range(HEADS):
            probs = (keys[:, h // group] @ q[p, h] * SCALE).softmax(0)
            expected[p, h] = probs @ values[:, h // group]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
