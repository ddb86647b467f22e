"""kv_cache.int4.sink_block (issue 46): every sequence's block 0 kept at the model dtype in the
float sink region (docs/kv-formats.md, "The sink block"). Each backend reads it as the
reference does; the engine stores it bit for bit, a prefix hit equals a miss, no block leaks."""

from __future__ import annotations

import pytest
import torch

from slimkv.backends import cpu_decode as kernels
from slimkv.attention.layer import PagedAttention
from slimkv.attention.metadata import AttentionMetadata
from slimkv.attention.reference import reference_paged_attention, sequence_context
from slimkv.backends import KERNELS
from slimkv.config import Config, ConfigError
from slimkv.engine.sampling import SamplingParams
from slimkv.kernels import build
from slimkv.kv.block_pool import BlockPool, hash_block
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging
from slimkv.llm import LLM

BS, H_KV, HQ, SINKS = 16, 3, 9, 8


def _step(lens: list[int], head_dim: int = 64, dtype: torch.dtype = torch.float32,
          k_dtype: str = "int4", num_sink: int = SINKS, done: list[int] | None = None):
    """A cache whose last ``num_sink`` ids are the sink region, each sequence's block 0 one
    of them (the rest shuffled regular ids), ``lens[i] - 1`` tokens prefilled through the
    backends' write, and a decode step of one more token each."""
    gen = torch.Generator().manual_seed(len(lens) + head_dim)
    regular = sum(-(-n // BS) for n in lens)
    cache = PagedKVCache(num_layers=1, num_blocks=regular + num_sink, block_size=BS,
                         num_kv_heads=H_KV, head_dim=head_dim, k_dtype=k_dtype, v_dtype=k_dtype,
                         k_scale="per_channel_block", device=torch.device("cpu"))
    staging = Staging(cache, len(lens), dtype, num_sink)
    order = torch.randperm(regular, generator=gen).tolist()
    sinks = (torch.randperm(num_sink, generator=gen) + regular).tolist()
    tables = []
    write = PagedAttention(cache, HQ, head_dim ** -0.5, dtype, staging=staging, kernels=KERNELS)
    for i, (n, m) in enumerate(zip(lens, done or [n - 1 for n in lens])):
        num = -(-n // BS)
        tables.append([sinks[i]] + order[:num - 1])
        order = order[num - 1:]
        if m:
            q, k, v = (torch.randn(m, h, head_dim, generator=gen, dtype=dtype) * 2
                       for h in (HQ, H_KV, H_KV))
            k[:4] *= 8  # outlying keys at the head, as the first tokens' are
            write(0, q, k, v, _meta([m], [m], [tables[-1]], [i]))
    meta = _meta([1] * len(lens), lens, tables, list(range(len(lens))))
    step = tuple(torch.randn(len(lens), h, head_dim, generator=gen, dtype=dtype) * 2
                 for h in (HQ, H_KV, H_KV))
    return cache, staging, step, meta


def _meta(query_lens, seq_lens, tables, slots) -> AttentionMetadata:
    return AttentionMetadata.build(BS, tables, query_lens, seq_lens, torch.device("cpu"), slots)


def _run(cache, staging, step, meta, dtype, backend):
    """The step on ``backend`` (None: the fused C kernel) from the same pool state, the
    reference over the pool that step wrote, the same in float64, and the layer."""
    saved = [t.clone() for t in (*cache.tensors().values(), staging.buffer)]
    attn = PagedAttention(cache, HQ, cache.head_dim ** -0.5, dtype, staging=staging,
                          backend=backend, kernels=KERNELS)
    out = attn(0, *step, meta)
    reference = reference_paged_attention(cache, 0, step[0], meta, cache.head_dim ** -0.5,
                                          dtype, staging)
    truth = _float64_reference(cache, staging, step[0], meta)
    for t, s in zip((*cache.tensors().values(), staging.buffer), saved):
        t.copy_(s)
    return out, reference, truth, attn


def _float64_reference(cache, staging, q, meta):
    """The reference's attention in float64 over the same (float32) keys and values."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // cache.num_kv_heads
    for i, q_len in enumerate(meta.query_lens):
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i] + q_len)
        k, v, mask = sequence_context(cache, staging, 0, meta, i, torch.float32)
        k, v = (x[0].double().repeat_interleave(group, dim=1) for x in (k, v))
        scores = torch.einsum("qhd,khd->hqk", q[rows].double(), k) * cache.head_dim ** -0.5
        probs = scores.masked_fill(~mask[0], float("-inf")).softmax(dim=-1)
        out[rows] = torch.einsum("hqk,khd->qhd", probs, v)
    return out


def _assert_as_close_as_float32(out, reference, truth):
    """``out`` no farther from the float64 ``truth`` than 1e-5 or twice the float32
    reference's own error. _step's inputs (x2, outlying keys x8) give outputs up to ~8,
    where two float32 attentions summed in different orders differ by ~1e-5 (1.6e-5 seen
    on an AVX2 Zen 3: the portable loop 9.0e-6 from float64, the reference 7.2e-6), so
    rtol=atol=1e-5 between the two sat on that floor; a wrong sink row is off by ~1e-1."""
    floor = (reference.double() - truth).abs().max().item()
    assert (out.double() - truth).abs().max().item() <= max(1e-5, 2 * floor)


LENS = [1, 16, 17, 40, 100]  # block 0 still staged, just full, then behind the own block


def _triton() -> None:
    from slimkv.kernels.triton import triton_unavailable_reason

    if (reason := triton_unavailable_reason("cpu")) is not None:
        pytest.skip(reason)


@pytest.mark.usefixtures("fused_kernel")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("backend", [None, "portable", "sdpa", "triton"])
def test_each_decode_path_reads_the_sink_as_the_reference(backend, head_dim, monkeypatch):
    if backend == "triton":
        _triton()
    if backend == "portable":
        monkeypatch.setattr(kernels._KERNEL, "_loaded",
                            kernels.DecodeKernel(build.load(kernels.SOURCE), "paged_decode_portable"))
    cache, staging, step, meta = _step(LENS, head_dim)
    out, reference, truth, attn = _run(cache, staging, step, meta, torch.float32,
                                       None if backend == "portable" else backend)
    path = {"sdpa": "fast_decode", "triton": "triton_decode"}.get(backend, "fused_decode")
    assert attn.path_counts == {path: 1}
    _assert_as_close_as_float32(out, reference, truth)


@pytest.mark.usefixtures("fused_kernel")
def test_bfloat16_sink_rows_through_the_tiled_path_as_the_portable_loop(monkeypatch):
    """A bf16 model's sink rows take the tiled path's vector conversion of staged rows."""
    captured = []
    lib = build.load(kernels.SOURCE)
    for name in ("paged_decode", "paged_decode_portable"):
        kernel = kernels.DecodeKernel(lib, name)

        def spy(*args, kernel=kernel):
            captured.append(kernel(*args))
            return captured[-1]

        monkeypatch.setattr(kernels._KERNEL, "_loaded", spy)
        cache, staging, step, meta = _step([5, 33, 47], 64, torch.bfloat16)
        _run(cache, staging, step, meta, torch.bfloat16, None)
    torch.testing.assert_close(captured[0], captured[1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("done, n", [(40, 20), (0, 40), (9, 30)])
@pytest.mark.parametrize("backend", ["sdpa", "cpu", "triton"])
def test_prefill_chunks_read_the_sink_as_the_reference(backend, done, n):
    """A chunk after a full block 0, one that fills it and goes on, one that starts inside
    it (torch paths: dequantized prefix, block 0's rows replaced by the float ones; Triton:
    the sink block's rows read from the staging buffer)."""
    if backend == "triton":
        _triton()
    cache, staging, _, meta0 = _step([done + n], done=[done])
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(n, h, 64, generator=gen) for h in (HQ, H_KV, H_KV))
    meta = _meta([n], [done + n], [meta0.block_tables[0].tolist()], [0])
    attn = PagedAttention(cache, HQ, 0.125, torch.float32, staging=staging, backend=backend,
                          kernels=KERNELS)
    staged = attn.backend.write(0, k, v, meta)
    out, _ = attn.backend.attend(0, q, meta, staged)
    reference = reference_paged_attention(cache, 0, q, meta, 0.125, torch.float32, staging,
                                          staged)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.usefixtures("fused_kernel")
def test_a_sink_read_from_the_wrong_row_or_the_pool_fails():
    """Mutation sanity: the kernel reading the next sink row, or block 0's quantized copy,
    no longer matches the reference; the reference itself depends on the sink."""
    cache, staging, step, meta = _step(LENS)
    good, reference, truth, _ = _run(cache, staging, step, meta, torch.float32, None)
    _assert_as_close_as_float32(good, reference, truth)
    attn = PagedAttention(cache, HQ, 0.125, torch.float32, staging=staging, kernels=KERNELS)
    saved = [t.clone() for t in (*cache.tensors().values(), staging.buffer)]
    for shift in (1, None):  # the next row; None: no sink (block 0 from the pool)
        for pair in attn.backend.sides:
            for side in pair:
                side.sink_from = 2**63 - 1 if shift is None else staging.sink_from
                side.sink_shift = staging.sink_shift + (shift or 0)
        for t, s in zip((*cache.tensors().values(), staging.buffer), saved):
            t.copy_(s)
        wrong = attn(0, *step, meta)
        rows = torch.tensor(LENS) > BS  # sequences whose block 0 is behind the own block
        assert not torch.allclose(wrong[rows], reference[rows], rtol=1e-3, atol=1e-3)


def test_the_sink_rows_hold_the_float_block_bit_for_bit():
    cache, staging, _, meta = _step([40])
    # Written again here, to compare with what went in.
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(40, H_KV, 64, generator=gen) for _ in range(2))
    table = meta.block_tables[:1, :3]
    staging.append(0, 0, 0, table[0], k, v)
    row = int(table[0, 0]) + staging.sink_shift
    assert torch.equal(staging.buffer[0, 0, row], k[:BS])
    assert torch.equal(staging.buffer[1, 0, row], v[:BS])


def test_the_sink_queue_serves_block_zero_and_gets_every_block_back():
    pool = BlockPool(10, num_sink=3)
    assert pool.num_blocks == 7 and pool.num_free_blocks == 7 and len(pool.sink_queue) == 3
    first = pool.get_new_blocks(3, sink=True)
    assert first[0].block_id >= 7 and all(b.block_id < 7 for b in first[1:])
    pool.cache_block(first[0], b"h" * 16)
    pool.set_session_head(first[:1], "s")
    pool.free_blocks(reversed(first))
    assert pool.num_free_blocks == 7 and len(pool.sink_queue) == 3
    pool.touch([first[0]])  # a prefix hit takes it back out of the sink queue
    assert len(pool.sink_queue) == 2 and pool.num_free_blocks == 7
    pool.free_blocks([first[0]])
    assert len(pool.sink_queue) == 3 and pool.free_queue.num_blocks == 7


def test_a_cached_sink_handed_out_again_leaves_its_hash_to_a_regular_copy():
    """Under chained hashes a lost block 0 loses the whole prefix: the sink's quantized copy
    goes to the least recently used regular block (on_demote copies it) with its hash."""
    pool, copies = BlockPool(10, num_sink=2), []
    pool.on_demote = lambda src, dst: copies.append((src, dst))
    head = pool.get_new_blocks(2, sink=True)
    assert [b.block_id for b in head] == [8, 0]
    pool.cache_block(head[0], b"h" * 16)
    pool.free_blocks(reversed(head))
    assert [b.block_id for b in pool.get_new_blocks(1, sink=True)] == [9]  # an empty sink first
    assert not copies
    assert [b.block_id for b in pool.get_new_blocks(2, sink=True)] == [8, 2]
    assert copies == [(8, 1)] and pool.get_cached_block(b"h" * 16) is pool.blocks[1]
    assert pool.blocks[8].block_hash is None and pool.blocks[1].state == "cached"
    assert pool.num_free_blocks == 7  # of 8: block 2 held, the copy free (cached)
    pool.on_demote = None  # no copier (or too few free blocks): the head is lost, as before
    pool.free_blocks(pool.blocks[8:9])
    pool.cache_block(pool.blocks[8], b"g" * 16)
    pool.get_new_blocks(1, sink=True)
    assert pool.get_cached_block(b"g" * 16) is None


# -- the engine ---------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _llm(**kv) -> LLM:
    kv = {"dtype": "int4", "memory_gb": None, "num_blocks": 48, "max_concurrency_soft": 3, **kv}
    return LLM(Config().replace("kv_cache", **kv).replace("model", dtype="float32"))


def _idle(llm: LLM) -> None:
    pool = llm.engine.pool
    assert pool.num_free_blocks == pool.num_blocks and len(pool.sink_queue) == pool.num_sink
    assert all(b.ref_cnt == 0 for b in pool.blocks)


@pytest.fixture(scope="module")
def sink_llm() -> LLM:
    return _llm()


def _prompt(llm: LLM, n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 20000, (n,), generator=gen).tolist()


@pytest.mark.slow
def test_engine_keeps_block_zero_at_float_and_a_hit_equals_a_miss(sink_llm: LLM):
    engine = sink_llm.engine
    assert engine.runner.num_sink == 2 * engine.runner.num_staging_slots > 0
    written = {}
    backend = engine.runner.attention.backend
    write = backend.write

    def spy(layer, k, v, meta):  # the float K/V each layer stores, first prefill
        written.setdefault(layer, (k[:BS].clone(), v[:BS].clone()))
        return write(layer, k, v, meta)

    backend.write = spy
    prompt = _prompt(sink_llm, 40, 0)
    seq = engine.add_request(prompt, GREEDY)
    engine.step()  # the prompt's prefill
    del backend.write
    sink_id = seq.blocks[0].block_id
    assert sink_id >= engine.pool.sink_from
    staging = engine.runner.staging
    for layer, (k, v) in written.items():
        row = sink_id + staging.sink_shift
        assert torch.equal(staging.buffer[0, layer, row], k.to(staging.buffer.dtype))
        assert torch.equal(staging.buffer[1, layer, row], v.to(staging.buffer.dtype))
    while engine.has_unfinished():
        engine.step()
    miss = seq.output_token_ids
    hit = sink_llm.generate([prompt], GREEDY)[0]
    assert hit.token_ids == list(miss)
    assert engine.manager.num_prefix_hits >= 2 * BS
    _idle(sink_llm)


@pytest.mark.slow
def test_engine_keeps_a_prefix_whose_sink_block_went_to_other_sequences(sink_llm: LLM):
    """Every sink block handed out again after the prompt's: its prefix is still hit, block 0
    from the regular copy of the sink's quantized block."""
    engine, cache = sink_llm.engine, sink_llm.engine.runner.cache
    prompt = _prompt(sink_llm, 40, 10)
    seq = engine.add_request(prompt, GREEDY)
    engine.step()
    sink_id = seq.blocks[0].block_id
    while engine.has_unfinished():
        engine.step()
    pooled = {name: t[:, sink_id].clone() for name, t in cache.tensors().items()}
    sink_llm.generate([_prompt(sink_llm, 20, 100 + i) for i in range(engine.pool.num_sink)],
                      GREEDY)
    copy = engine.pool.get_cached_block(hash_block(None, prompt[:BS]))
    assert copy is not None and copy.block_id < engine.pool.sink_from
    for name, t in cache.tensors().items():
        assert torch.equal(t[:, copy.block_id], pooled[name]), name
    hits = engine.manager.num_prefix_hits
    assert len(sink_llm.generate([prompt], GREEDY)[0].token_ids) == GREEDY.max_tokens
    assert engine.manager.num_prefix_hits - hits == 2 * BS
    _idle(sink_llm)


@pytest.mark.slow
def test_engine_preemption_with_the_sink_completes_and_leaks_nothing(sink_llm: LLM):
    prompts = [_prompt(sink_llm, 40, s) for s in range(1, 4)]
    expected = [r.token_ids for r in sink_llm.generate(prompts, GREEDY)]
    tight = _llm(num_blocks=8, enable_prefix_caching=False)
    got = [r.token_ids for r in tight.generate(prompts, GREEDY)]
    assert tight.engine.scheduler.num_preemptions > 0
    assert got == expected
    _idle(tight)


@pytest.mark.slow
def test_only_int4_caches_get_a_sink():
    for dtype in ("int8", "fp8", "float32"):
        config = Config().replace("kv_cache", dtype=dtype)
        assert config.kv_cache.int4.sink_block is None  # auto: on where served, int4 only
    assert Config.from_dict({"kv_cache": {"int4": {"sink_block": False}}}).kv_cache.int4.sink_block is False
    with pytest.raises(ConfigError, match="kv_cache.int4.sink_blok"):
        Config.from_dict({"kv_cache": {"int4": {"sink_blok": False}}})
    with pytest.raises(ConfigError, match="kv_cache.int4.sink_block"):
        Config.from_dict({"kv_cache": {"int4": {"sink_block": "yes"}}})
    for dtype in ("int8", "fp8_e4m3", "float32"):  # a sink for int4 caches only
        assert _llm(dtype=dtype, int4={"sink_block": True}).engine.runner.num_sink == 0


@pytest.mark.slow
def test_offload_with_the_sink_is_refused_naming_both_keys(tmp_path):
    from slimkv.plugins import build_engine

    config = Config().replace("kv_cache", dtype="int4", memory_gb=None, num_blocks=32,
                              max_concurrency_soft=2, offload={"host_gb": 0.01},
                              int4={"sink_block": True}).replace(
        "model", dtype="float32")
    with pytest.raises(ConfigError, match="kv_cache.offload.*kv_cache.int4.sink_block"):
        build_engine(config)
    auto = build_engine(config.replace("kv_cache", int4={}))  # null: off with the offload tier
    assert auto.runner.num_sink == 0


@pytest.mark.parametrize("backend", [None, "sdpa", "triton"])
def test_a_decode_that_fills_block_zero_keeps_it_and_the_next_reads_it(backend):
    if backend == "triton":
        _triton()
    """15 tokens prefilled, the 16th decoded (block 0 fills from the staging slot), then the
    17th: its block 0 comes from the float row, and the pool's quantized copy would differ."""
    cache, staging, _, meta = _step([17], done=[15])
    table = meta.block_tables[0].tolist()
    gen = torch.Generator().manual_seed(5)
    steps = [tuple(torch.randn(1, h, 64, generator=gen) for h in (HQ, H_KV, H_KV)) for _ in "ab"]
    attn = PagedAttention(cache, HQ, 0.125, torch.float32, staging=staging, backend=backend,
                          kernels=KERNELS)
    attn(0, *steps[0], _meta([1], [16], [table], [0]))
    row = table[0] + staging.sink_shift
    assert torch.equal(staging.buffer[:, 0, row], staging.buffer[:, 0, 0])  # slot 0: block 0
    meta = _meta([1], [17], [table], [0])
    out = attn(0, *steps[1], meta)
    reference = reference_paged_attention(cache, 0, steps[1][0], meta, 0.125, torch.float32,
                                          staging)
    torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
    staging.num_sink = 0  # the torch paths would read block 0's quantized copy instead
    pool_copy = reference_paged_attention(cache, 0, steps[1][0], meta, 0.125, torch.float32,
                                          staging)
    assert not torch.allclose(pool_copy, reference, rtol=1e-3, atol=1e-3)


def test_block_zero_is_quantized_when_the_sink_region_has_none_free():
    pool = BlockPool(6, num_sink=1)
    a = pool.get_new_blocks(2, sink=True)
    b = pool.get_new_blocks(2, sink=True)  # the region's one block is a's
    assert [x.block_id for x in a] == [5, 0] and [x.block_id for x in b] == [1, 2]
    pool.free_blocks(reversed(a))
    pool.free_blocks(reversed(b))
    assert pool.num_free_blocks == 5 and len(pool.sink_queue) == 1
    assert [x.block_id for x in pool.get_new_blocks(6, sink=True)][:2] == [5, 3]  # all 6
    with pytest.raises(ValueError, match="asked for 1 blocks, 0 free"):
        pool.get_new_blocks(1, sink=True)  # no sink free either: a regular block is needed


def _budget_llm(sink_block: bool | None = None) -> LLM:
    # ~20 MiB: a sixteenth holds one float32 sink block (and its pool block), not two.
    return _llm(num_blocks=None, memory_gb=0.02, int4={"sink_block": sink_block})


@pytest.mark.slow
def test_the_sink_region_takes_at_most_a_sixteenth_of_the_budget():
    runner = _budget_llm().engine.runner
    dims = (runner.cache.num_layers, runner.cache.num_kv_heads, runner.cache.head_dim)
    float_block = 2 * BS * dims[0] * dims[1] * dims[2] * 4     # K and V rows, float32
    one = float_block + PagedKVCache.block_bytes(
        num_layers=dims[0], num_kv_heads=dims[1], head_dim=dims[2], k_dtype="int4",
        v_dtype="int4", k_scale="per_channel_block", block_size=BS)
    budget = int(0.02 * 2**30)
    assert runner.num_sink == 1 < 2 * runner.num_staging_slots
    assert one * runner.num_sink <= budget / 16 < one * (runner.num_sink + 1)


@pytest.mark.slow
def test_past_the_sink_region_a_sequence_runs_as_without_a_sink():
    """Two prompts at once and one sink block: the first takes it and generates what an engine
    with sinks to spare gives it; the second's block 0 is quantized, and it generates what an
    engine without a sink gives it."""
    prompts = [_prompt(None, 40, 7), _prompt(None, 40, 8)]
    capped = _budget_llm()
    engine = capped.engine
    seqs = [engine.add_request(p, GREEDY) for p in prompts]
    engine.step()  # both prompts' prefill
    sink_from = engine.pool.sink_from
    assert engine.runner.num_sink == 1
    assert seqs[0].blocks[0].block_id >= sink_from > seqs[1].blocks[0].block_id
    while engine.has_unfinished():
        engine.step()
    spare = [r.token_ids for r in _llm().generate(prompts, GREEDY)]
    none = [r.token_ids for r in _budget_llm(False).generate(prompts, GREEDY)]
    got = [list(s.output_token_ids) for s in seqs]
    assert got[0] == spare[0] and got[1] == none[1]
    _idle(capped)
