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
stays piece by piece.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from slimkv.attention import prefill
from slimkv.kernels import build
from slimkv.kernels.prefill_attn import PrefillKernel
from slimkv.kv.staging import StagedKV


@functools.cache
def _pieces_fn(kernel: PrefillKernel):
    """``kernel``'s library's ``prefill_attention_staged`` (None: an older build in an A/B,
    whose ``prefill_attention_pieces`` read a mask per piece; a test's stand-in)."""
    fn = getattr(getattr(kernel, "lib", None), "prefill_attention_staged", None)
    i32, i64, ptr = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
    return fn and build.signature(fn, [ptr, i64] * 5 + [ptr, i32, ptr, i64, i32, i32, i32,
                                                        ctypes.c_float])


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
    table = torch.tensor([(p.rows.start, p.rows.stop, p.num_pool_keys, p.staged.start,
                           p.staged.stop, start + p.rows.start, block_size)
                          for p in chunk_pieces], dtype=torch.int64)  # [pieces, 7]
    out = torch.empty(q.shape, dtype=q.dtype)
    _pieces_fn(kernel)(*(a for x in (q, pool_k, pool_v, staged_k, staged_v)
                         for a in (x.data_ptr(), x.stride(0))), table.data_ptr(), len(table),
                       out.data_ptr(), out.stride(0), q.shape[1], pool_k.shape[1], q.shape[2],
                       scale)
    return out


def one_call(q: Tensor, k: Tensor, v: Tensor, staged: StagedKV | None,
             chunk_pieces: tuple[prefill.Piece, ...], start: int, block_size: int,
             scale: float) -> Tensor | None:
    """The chunk's ``q [n, Hq, D]`` (positions from ``start`` on) over its pool keys ``k, v
    [L, H, D]`` and ``staged`` in ``chunk_pieces`` (:func:`slimkv.attention.prefill.run`'s
    result bit for bit) -> ``[n, Hq, D]``, or None where the kernel does not take them (the
    caller goes piece by piece)."""
    if staged is None or type(q) is not torch.Tensor or q.dtype != torch.bfloat16:
        return None
    kernel = prefill.prefill_kernel()  # looked up there: tests and benches swap it
    if kernel is None or _pieces_fn(kernel) is None:
        return None
    staged_k, staged_v = staged.k.to(k.dtype), staged.v.to(v.dtype)  # as prefill.run
    fits = all(p.staged is not None and p.num_pool_keys % 16 == 0 and p.staged.start % 16 == 0
               and p.num_pool_keys <= len(k) and p.staged.stop <= len(staged_k)
               and staged.start + p.staged.start == (start + p.rows.start) // block_size
               * block_size for p in chunk_pieces)
    if not (fits and kernel.takes(q, k, v, None) and kernel.takes(q, staged_k, staged_v, None)):
        return None
    return pieces(kernel, q, k, v, staged_k, staged_v, chunk_pieces, start, block_size, scale)
