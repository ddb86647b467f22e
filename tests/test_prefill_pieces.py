"""A staged chunk's pieces in one prefill kernel call (backends/cpu_prefill.pieces, issue 47) give
today's per-piece calls (slimkv.attention.prefill.run) bit for bit: first chunks, chunks
after a prefix (pieces starting mid-block, pool prefixes not a multiple of 64 keys), partial
last blocks, ragged chunk sizes, grouped heads, head dims 64, 96 (the generic path) and 128,
outliers. A wrong table (staged slice a tile off, a tile of pool keys short) shows the
comparison can fail. Over an int8 pool the one call reads the codes and scales itself
(cpu_prefill.one_call_int8): the call over the kv_blocks kernel's dequantized copy bit for
bit, for both key scale layouts, and kernels built with a wrong scale or slot fail that. End
to end: the CPU engine's tokens, pool and staging bytes with int8, int4 and fp8 KV equal the
per-piece path's."""

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
    tokens, every pool tensor, the staging buffer, and how many one-call prefills ran (int8:
    the one call that reads the pool's codes)."""
    config = Config().replace("kv_cache", dtype=kv_dtype, memory_gb=None, num_blocks=160,
                              max_concurrency_soft=4).replace("model", dtype="bfloat16")
    llm = LLM(config.replace("scheduler", max_num_batched_tokens=256))
    backend = llm.engine.runner.attention.backend
    assert isinstance(backend, CpuBackend) and llm.engine.runner.staging is not None
    backend.one_call_prefill = one_call
    calls = []
    for name in ("pieces", "pieces_int8"):  # int8: the call that reads the pool's codes
        fn = getattr(cpu_prefill, name)
        monkeypatch.setattr(cpu_prefill, name, lambda *args, fn=fn: calls.append(1) or fn(*args))
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


# -- over an int8 pool: the pool keys packed from the codes ---------------------------------

def _int8_pool(k_scale: str, k: torch.Tensor, v: torch.Tensor, seed: int):
    """``k, v [L, H, D]`` written by the codecs into shuffled blocks of a fresh int8 pool:
    its layer-0 sides, their scale modes and the sequence's block ids."""
    from slimkv.backends.cpu_kv import int8_mode
    from slimkv.kv.cache import PagedKVCache

    _, heads, dim = k.shape
    n = -(-len(k) // BS)
    cache = PagedKVCache(num_layers=1, num_blocks=n + 9, block_size=BS, num_kv_heads=heads,
                         head_dim=dim, k_dtype="int8", v_dtype="int8", k_scale=k_scale,
                         device="cpu")
    ids = torch.randperm(n + 9, generator=torch.Generator().manual_seed(seed))[:n]
    pad = n * BS - len(k)
    k, v = (torch.cat((x, x[:pad])).unflatten(0, (n, BS)) for x in (k, v))
    cache.write_blocks(0, ids, k, v)  # the torch codecs: the reference's bytes
    sides = tuple(cache.layer_pool(side, 0) for side in ("k", "v"))
    return sides, tuple(int8_mode(cache.layer_codecs[0][s]) for s in ("k", "v")), ids


def _int8_case(kernel, k_scale: str, seq_len: int, query_len: int, heads, head_dim: int):
    """The one call over an int8 pool's codes and, as the reference, :func:`pieces` over
    the kv_blocks kernel's dequantized bf16 copy of the same blocks."""
    from slimkv.backends.cpu_kv import kv_blocks_kernel

    blocks = kv_blocks_kernel()
    if blocks is None:
        pytest.skip("kv_blocks.c cannot be built here")
    q, k, v, staged, pieces = _chunk(seq_len, query_len, heads, head_dim, seq_len + 7)
    sides, modes, ids = _int8_pool(k_scale, k, v, seq_len)
    start, scale = seq_len - query_len, head_dim ** -0.5
    pool = max(p.num_pool_keys for p in pieces)
    used = ids[:-(-pool // BS)]
    kd, vd = (blocks.read(side, mode, used, torch.bfloat16, len(used) * BS)
              for side, mode in zip(sides, modes))
    want = cpu_prefill.pieces(kernel, q, kd, vd, staged.k, staged.v, pieces, start, BS, scale)
    args = (q, *sides, modes, used, staged, pieces, start, BS, scale)
    return want, args


@pytest.mark.parametrize("k_scale", ["per_channel_block", "per_token"])
@pytest.mark.parametrize("seq_len, query_len, heads, head_dim", CASES)
def test_int8_one_call_equals_the_call_over_a_dequantized_copy(kernel, k_scale, seq_len,
                                                               query_len, heads, head_dim):
    want, args = _int8_case(kernel, k_scale, seq_len, query_len, heads, head_dim)
    got = cpu_prefill.one_call_int8(*args)
    assert got is not None and torch.equal(got, want)


def _mutant(tmp, source: str, old: str, new: str) -> PrefillKernel:
    """The prefill kernel built in ``tmp`` with ``old`` replaced by ``new`` in kv_int8.h
    (``source``)."""
    import shutil

    from slimkv.kernels import build
    from slimkv.kernels.prefill_attn import SOURCE

    tmp.mkdir()
    for f in (SOURCE, *SOURCE.parent.glob("*.h")):
        shutil.copy(f, tmp)
    assert old in source
    (tmp / "kv_int8.h").write_text(source.replace(old, new))
    lib = build.load(tmp / SOURCE.name)
    assert not isinstance(lib, str), lib
    return PrefillKernel(lib)


def test_a_wrong_scale_or_slot_in_the_int8_read_fails_the_comparison(kernel, monkeypatch,
                                                                      tmp_path):
    """Kernels built with a wrong scale (a neighbouring channel's, or token's) or a wrong
    slot (the neighbouring token's codes under this token's scale: a slot swapped in keys and
    values alike would only permute a block's keys) differ from the reference; the unchanged
    source agrees."""
    from slimkv.kernels.prefill_attn import SOURCE

    header = SOURCE.with_name("kv_int8.h").read_text()
    mutations = {  # (k_scale, old, new)
        "channel scale": ("per_channel_block", "(float)s[d]", "(float)s[d ^ 1]"),
        "token scale": ("per_token", "p->scale[(b * p->bs + t) * H + h]",
                        "p->scale[(b * p->bs + (t ^ 1)) * H + h]"),
        "slot": ("per_token", "p->data + ((b * p->bs + t) * H",
                 "p->data + ((b * p->bs + (t ^ 1)) * H"),
    }
    for i, (name, (k_scale, old, new)) in enumerate(mutations.items()):
        want, args = _int8_case(kernel, k_scale, 500, 200, (9, 3), 64)
        for j, (text, equal) in enumerate(((new, False), (old, True))):
            built = _mutant(tmp_path / f"{i}-{j}", header, old, text)
            monkeypatch.setattr(prefill, "prefill_kernel", lambda: built)
            assert torch.equal(cpu_prefill.one_call_int8(*args), want) == equal, name
