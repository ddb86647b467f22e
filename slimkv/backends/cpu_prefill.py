"""A staged prefill chunk's pieces in one call of the prefill kernel (issue 47).

Over a staged cache, each 128-row piece of a chunk attends the pool keys before its last
block, then its own staged keys (:mod:`slimkv.attention.prefill`). Piece by piece, every
call packs the pool keys and widens the values again in an OpenMP region of its own, after
its staged keys are copied in behind them: ~15 ms of a 512-token chunk over 30 layers that a
bf16 cache's one causal call does not pay. :func:`pieces` (the kernel library's
``prefill_attention_staged``) packs them once for all the pieces and gives each the very
bits of its own call, without reading their masks. It takes a bf16 chunk
whose pieces' pool keys and staged slices start on 16-key tiles (a block size of 16 or
more); anything else (a float32 model, the start-up replay's fake tensors, smaller blocks)
stays piece by piece. Over an int8 pool, :func:`one_call_int8` packs the pool keys straight
from the codes and scales (``prefill_attention_staged_int8``): no dequantized copy of the
prefix, the same bits.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from slimkv.attention import prefill
from slimkv.kernels import build
from slimkv.kernels.prefill_attn import PrefillKernel
from slimkv.kv.quant import QuantizedKV
from slimkv.kv.staging import StagedKV

_I32, _I64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_TAIL = [_PTR, _I32, _PTR, _I64, _I32, _I32, _I32, ctypes.c_float]  # table .. scale


@functools.cache
def _pieces_fn(kernel: PrefillKernel):
    """``kernel``'s library's ``prefill_attention_staged`` (None: an older build in an A/B,
    whose ``prefill_attention_pieces`` read a mask per piece; a test's stand-in)."""
    fn = getattr(getattr(kernel, "lib", None), "prefill_attention_staged", None)
    return fn and build.signature(fn, [_PTR, _I64] * 5 + _TAIL)


@functools.cache
def _int8_fn(kernel: PrefillKernel):
    """``kernel``'s ``prefill_attention_staged_int8`` (None: a build without it)."""
    fn = getattr(getattr(kernel, "lib", None), "prefill_attention_staged_int8", None)
    return fn and build.signature(fn, [_PTR, _I64] + [_PTR, _PTR, _I32] * 2 + [_PTR, _I32]
                                  + [_PTR, _I64] * 2 + _TAIL)


def _table(chunk_pieces, start: int, block_size: int) -> Tensor:
    """The kernel's table: one row per piece (see ``prefill_attention_staged``)."""
    return torch.tensor([(p.rows.start, p.rows.stop, p.num_pool_keys, p.staged.start,
                          p.staged.stop, start + p.rows.start, block_size)
                         for p in chunk_pieces], dtype=torch.int64)  # [pieces, 7]


def pieces(kernel: PrefillKernel, q: Tensor, pool_k: Tensor, pool_v: Tensor, staged_k: Tensor,
           staged_v: Tensor, chunk_pieces, start: int, block_size: int,
           scale: float) -> Tensor:
    """A staged chunk's pieces (:class:`slimkv.attention.prefill.Piece`: rows, pool keys a
    multiple of 16, staged slice starting at one) of ``q [n, Hq, D]``, the chunk's positions
    from ``start`` on, in one call, keys packed once for all: piece ``p`` over ``pool_k,
    pool_v [:p.num_pool_keys]`` then ``staged_k, staged_v [p.staged]`` (``[L, H, D]``, see
    :meth:`PrefillKernel.takes`), bit for bit what ``kernel`` gives it over their
    concatenation under its mask. The kernel reads no mask: what a query sees follows from
    its position and ``block_size`` (:func:`slimkv.kv.staging.staged_mask`'s rule)."""
    table = _table(chunk_pieces, start, block_size)
    out = torch.empty(q.shape, dtype=q.dtype)
    _pieces_fn(kernel)(*(a for x in (q, pool_k, pool_v, staged_k, staged_v)
                         for a in (x.data_ptr(), x.stride(0))), table.data_ptr(), len(table),
                       out.data_ptr(), out.stride(0), q.shape[1], pool_k.shape[1], q.shape[2],
                       scale)
    return out


def pieces_int8(kernel: PrefillKernel, q: Tensor, pool_k: QuantizedKV, pool_v: QuantizedKV,
                modes: tuple[int, int], block_ids: Tensor, staged_k: Tensor, staged_v: Tensor,
                chunk_pieces, start: int, block_size: int, scale: float) -> Tensor:
    """:func:`pieces` with the pool keys and values read from one layer's int8 pool sides
    (codes ``[blocks, bs, H, D]``, float16 scales of ``modes``: see
    :func:`slimkv.backends.cpu_kv.int8_mode`) through the sequence's ``block_ids`` (int64,
    enough for every piece's pool keys): what :func:`pieces` gives over
    :meth:`slimkv.backends.cpu_kv.KVBlocks.read`'s bf16 copy of them, bit for bit."""
    table = _table(chunk_pieces, start, block_size)
    out = torch.empty(q.shape, dtype=q.dtype)
    sides = (a for pool, mode in zip((pool_k, pool_v), modes)
             for a in (pool.data.data_ptr(), pool.aux["scale"].data_ptr(), mode))
    _int8_fn(kernel)(q.data_ptr(), q.stride(0), *sides, block_ids.data_ptr(), block_size,
                     staged_k.data_ptr(), staged_k.stride(0), staged_v.data_ptr(),
                     staged_v.stride(0), table.data_ptr(), len(table), out.data_ptr(),
                     out.stride(0), q.shape[1], pool_k.data.shape[2], q.shape[2], scale)
    return out


def _taken(q: Tensor, staged: StagedKV | None, num_pool: int, chunk_pieces, start: int,
           block_size: int, lookup) -> tuple[PrefillKernel, Tensor, Tensor] | None:
    """The kernel, staged K and V where the one call takes the chunk (``lookup``: its entry
    in the kernel's library; ``num_pool``: the pool keys at hand), else None."""
    if staged is None or type(q) is not torch.Tensor or q.dtype != torch.bfloat16:
        return None
    kernel = prefill.prefill_kernel()  # looked up there: tests and benches swap it
    if kernel is None or lookup(kernel) is None:
        return None
    staged_k, staged_v = staged.k.to(q.dtype), staged.v.to(q.dtype)  # as prefill.run
    fits = all(p.staged is not None and p.num_pool_keys % 16 == 0 and p.staged.start % 16 == 0
               and p.num_pool_keys <= num_pool and p.staged.stop <= len(staged_k)
               and staged.start + p.staged.start == (start + p.rows.start) // block_size
               * block_size for p in chunk_pieces)
    return (kernel, staged_k, staged_v) if fits and kernel.takes(q, staged_k, staged_v, None) \
        else None


def one_call(q: Tensor, k: Tensor, v: Tensor, staged: StagedKV | None,
             chunk_pieces: tuple[prefill.Piece, ...], start: int, block_size: int,
             scale: float) -> Tensor | None:
    """The chunk's ``q [n, Hq, D]`` (positions from ``start`` on) over its pool keys ``k, v
    [L, H, D]`` and ``staged`` in ``chunk_pieces`` (:func:`slimkv.attention.prefill.run`'s
    result bit for bit) -> ``[n, Hq, D]``, or None where the kernel does not take them (the
    caller goes piece by piece)."""
    taken = _taken(q, staged, len(k), chunk_pieces, start, block_size, _pieces_fn)
    if taken is None or not taken[0].takes(q, k, v, None):
        return None
    return pieces(taken[0], q, k, v, *taken[1:], chunk_pieces, start, block_size, scale)


def one_call_int8(q: Tensor, pool_k: QuantizedKV, pool_v: QuantizedKV, modes: tuple[int, int],
                  block_ids: Tensor, staged: StagedKV | None,
                  chunk_pieces: tuple[prefill.Piece, ...], start: int, block_size: int,
                  scale: float) -> Tensor | None:
    """:func:`one_call` over an int8 pool's blocks ``block_ids`` of the sequence (see
    :func:`pieces_int8`) instead of a dequantized copy, or None where the kernel does not
    take them."""
    taken = _taken(q, staged, len(block_ids) * block_size, chunk_pieces, start, block_size,
                   _int8_fn)
    if taken is None or pool_k.data.shape[1] != block_size:
        return None
    ids = block_ids.to(torch.int64).contiguous()
    return pieces_int8(taken[0], q, pool_k, pool_v, modes, ids, *taken[1:], chunk_pieces, start,
                       block_size, scale)
