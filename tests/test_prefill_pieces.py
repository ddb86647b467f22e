"""A staged chunk's pieces in one prefill kernel call (backends/cpu_prefill.pieces, issue 47) give
today's per-piece calls (slimkv.attention.prefill.run) bit for bit: first chunks, chunks
after a prefix (pieces starting mid-block, pool prefixes not a multiple of 64 keys), partial
last blocks, ragged chunk sizes, grouped heads, head dims 64, 96 (the generic path) and 128,
outliers. A wrong table (staged slice a tile off, a tile of pool keys short) shows the
comparison can fail. End to end: the CPU engine's tokens, pool and staging bytes with int8,
int4 and fp8 KV equal the per-piece path's."""

from __future__ import annotations

import pytest
import torch

from slimkv.attention import prefill
from slimkv.backends import cpu_prefill
from slimkv.backends.cpu import CpuBackend
from slimkv.config import Config
from slimkv.engine.sampling import SamplingParams
from slimkv.kernels.prefill_attn import (PrefillKernel, prefill_kernel,
                                         prefill_kernel_unavailable_reason)
from slimkv.kv.staging import StagedKV
from slimkv.llm import LLM

BS, CPU = 16, torch.device("cpu")


@pytest.fixture(scope="module")
def kernel() -> PrefillKernel:
    loaded = prefill_kernel()
    if loaded is None:
        pytest.skip(prefill_kernel_unavailable_reason())
    return loaded


def _chunk(seq_len: int, query_len: int, heads: tuple[int, int], head_dim: int, seed: int):
    """A chunk's ``q``, its pool keys and values (dequantized: not the staged ones), its
    staged K/V and pieces; bf16 with outlier query rows, keys, values and channels."""
    gen = torch.Generator().manual_seed(seed)
    (num_heads, num_kv_heads), start = heads, seq_len - query_len
    staged_start = start // BS * BS
    q = torch.randn(query_len, num_heads, head_dim, generator=gen) * 2
    k, v, staged_k, staged_v = (torch.randn(n, num_kv_heads, head_dim, generator=gen)
                                for n in (seq_len, seq_len, seq_len - staged_start,
                                          seq_len - staged_start))
    q[::37] *= 20
    for x in (k, staged_k):
        x[::29] *= 30
        x[..., 5] *= 10
    for x in (v, staged_v):
        x[::41] *= 25
    q, k, v, staged_k, staged_v = (x.bfloat16() for x in (q, k, v, staged_k, staged_v))
    pieces = tuple(prefill.plan(seq_len, query_len, staged_start, BS, torch.bfloat16, CPU))
    return q, k, v, StagedKV(staged_start, staged_k, staged_v), pieces


CASES = [  # seq_len, query_len, (Hq, H), D
    (512, 512, (9, 3), 64),    # a first chunk of 512 (SmolLM2's heads)
    (500, 200, (9, 3), 64),    # 300 cached + 200 new: mid-block start, 416 pool keys
    (613, 301, (9, 3), 128),   # ragged chunk, partial last block
    (77, 77, (9, 3), 64),      # one piece, partial last block
    (10, 10, (8, 2), 64),      # inside block 0: no pool keys
    (1000, 333, (8, 2), 128),  # G = 4, long prefix
    (400, 130, (4, 2), 96),    # head dim through the generic path
    (300, 44, (4, 4), 256),    # G = 1, D = 256
]


@pytest.mark.parametrize("seq_len, query_len, heads, head_dim", CASES)
def test_one_call_equals_the_pieces_one_by_one(kernel, seq_len, query_len, heads, head_dim):
    q, k, v, staged, pieces = _chunk(seq_len, query_len, heads, head_dim, seq_len + query_len)
    scale = head_dim ** -0.5
    want = prefill.run(pieces, q, k, v, staged, scale)  # each piece in the kernel
    got = cpu_prefill.pieces(kernel, q, k, v, staged.k, staged.v, pieces, seq_len - query_len,
                             BS, scale)
    assert torch.equal(got, want)


def test_strided_queries_and_unread_pool_keys(kernel) -> None:
    """q as a view into a wider (fused QKV) row; pool keys past every piece's prefix and
    staged keys past a piece's slice (the next piece's) are never read as its keys."""
    q, k, v, staged, pieces = _chunk(500, 200, (9, 3), 64, 5)
    wide = torch.zeros(200, 15, 64, dtype=torch.bfloat16)
    wide[:, :9] = q
    want = prefill.run(pieces, q, k, v, staged, 0.125)
    pool = max(p.num_pool_keys for p in pieces)
    k[pool:], v[pool:] = float("nan"), float("nan")
    assert torch.equal(cpu_prefill.pieces(kernel, wide[:, :9], k, v, staged.k, staged.v, pieces,
                                          300, BS, 0.125), want)


def test_a_wrong_table_fails_the_comparison(kernel) -> None:
    """The comparison can fail: a piece reading its staged keys one tile late, or one tile
    of pool keys short, differs from the per-piece run; so do queries placed one position
    late (each then sees one staged key more) and a block size of 32 for 16."""
    q, k, v, staged, pieces = _chunk(512, 512, (9, 3), 64, 1)
    want = prefill.run(pieces, q, k, v, staged, 0.125)
    p = pieces[1]
    late = prefill.Piece(p.rows, p.num_pool_keys, slice(p.staged.start + BS, p.staged.stop + BS),
                         p.mask)
    short = prefill.Piece(p.rows, p.num_pool_keys - BS, p.staged, p.mask)
    for wrong in (late, short):
        got = cpu_prefill.pieces(kernel, q, k, v, staged.k, staged.v,
                                 (pieces[0], wrong, *pieces[2:]), 0, BS, 0.125)
        assert not torch.equal(got, want)
        assert torch.equal(got[:p.rows.start], want[:p.rows.start])  # only that piece moved
        assert torch.equal(got[p.rows.stop:], want[p.rows.stop:])
    assert torch.equal(cpu_prefill.pieces(kernel, q, k, v, staged.k, staged.v, pieces, 0, BS,
                                          0.125), want)
    for start, block_size in ((1, BS), (0, 2 * BS)):
        got = cpu_prefill.pieces(kernel, q, k, v, staged.k, staged.v, pieces, start,
                                 block_size, 0.125)
        assert not torch.equal(got, want)


def test_the_backend_goes_piece_by_piece_where_the_kernel_does_not_take_the_chunk(kernel):
    """Blocks of 4 (pieces off the 16-key tiles), float32 and unstaged chunks: no one call."""
    from slimkv.backends import cpu_prefill

    q, k, v, staged, pieces = _chunk(512, 512, (9, 3), 64, 2)
    assert cpu_prefill.one_call(q, k, v, staged, pieces, 0, BS, 0.125) is not None
    small = tuple(prefill.plan(100, 50, 48, 4, torch.bfloat16, CPU, piece=8))
    assert cpu_prefill.one_call(q[:50], k, v, staged, small, 50, 4, 0.125) is None
    assert cpu_prefill.one_call(q.float(), k.float(), v.float(), staged, pieces, 0, BS,
                                0.125) is None
    assert cpu_prefill.one_call(q, k, v, None, pieces, 0, BS, 0.125) is None


# -- the engine ---------------------------------------------------------------------------

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def _engine_run(kv_dtype: str, one_call: bool, monkeypatch) -> tuple:
    """Prompts of ~600 tokens prefilled in chunks of up to 256 (two at once, so chunks
    start mid-block beside a decode), then a prefix hit and a prompt sharing 25 blocks:
    tokens, every pool tensor, the staging buffer, and how many one-call prefills ran."""
    config = Config().replace("kv_cache", dtype=kv_dtype, memory_gb=None, num_blocks=160,
                              max_concurrency_soft=4).replace("model", dtype="bfloat16")
    llm = LLM(config.replace("scheduler", max_num_batched_tokens=256))
    backend = llm.engine.runner.attention.backend
    assert isinstance(backend, CpuBackend) and llm.engine.runner.staging is not None
    backend.one_call_prefill = one_call
    calls = []
    pieces = cpu_prefill.pieces
    monkeypatch.setattr(cpu_prefill, "pieces", lambda *args: calls.append(1) or pieces(*args))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 20000, (n,), generator=gen).tolist() for n in (600, 590)]
    tokens = [r.token_ids for r in llm.generate(prompts, GREEDY)]
    shared = prompts[0][:400] + prompts[1][:170]  # 25 blocks hit, the rest in two chunks
    tokens += [r.token_ids for r in llm.generate([prompts[0], shared], GREEDY)]
    assert llm.engine.manager.num_prefix_hits >= 400
    runner = llm.engine.runner
    pool = {name: t.clone() for name, t in runner.cache.tensors().items()}
    return tokens, pool, runner.staging.buffer.clone(), len(calls)


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["int8", "int4", "fp8"])
def test_engine_one_call_prefill_equals_the_per_piece_path(kernel, kv_dtype, monkeypatch):
    tokens, pool, staging, calls = _engine_run(kv_dtype, True, monkeypatch)
    want_tokens, want_pool, want_staging, old_calls = _engine_run(kv_dtype, False, monkeypatch)
    assert calls > 0 and old_calls == 0
    assert tokens == want_tokens
    for name, t in want_pool.items():
        assert torch.equal(pool[name], t), name
    assert torch.equal(staging, want_staging)
