"""A staged prefill chunk's pieces in one call of the prefill kernel (issue 47).

Over a staged cache, each 128-row piece of a chunk attends the pool keys before its last
block, then its own staged keys (:mod:`slimkv.attention.prefill`). Piece by piece, every
call packs the pool keys and widens the values again in an OpenMP region of its own, after
its staged keys are copied in behind them: ~15 ms of a 512-token chunk over 30 layers that a
bf16 cache's one causal call does not pay. :meth:`PrefillKernel.pieces` packs them once
for all the pieces and gives each the very bits of its own call. It takes a bf16 chunk
whose pieces' pool keys and staged slices start on 16-key tiles (a block size of 16 or
more); anything else (a float32 model, the start-up replay's fake tensors, smaller blocks)
stays piece by piece.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimkv.attention import prefill
from slimkv.kv.staging import StagedKV


def one_call(q: Tensor, k: Tensor, v: Tensor, staged: StagedKV | None,
             pieces: tuple[prefill.Piece, ...], scale: float) -> Tensor | None:
    """The chunk's ``q [n, Hq, D]`` over its pool keys ``k, v [L, H, D]`` and ``staged``
    in ``pieces`` (:func:`slimkv.attention.prefill.run`'s result bit for bit) -> ``[n, Hq,
    D]``, or None where the kernel does not take them (the caller goes piece by piece)."""
    if staged is None or type(q) is not torch.Tensor or q.dtype != torch.bfloat16:
        return None
    kernel = prefill.prefill_kernel()  # looked up there: tests and benches swap it
    if getattr(kernel, "pieces_fn", None) is None:  # none here, an older build, a test's
        return None
    staged_k, staged_v = staged.k.to(k.dtype), staged.v.to(v.dtype)  # as prefill.run
    fits = all(p.staged is not None and p.mask is not None and p.num_pool_keys % 16 == 0
               and p.staged.start % 16 == 0 and p.num_pool_keys <= len(k)
               and p.staged.stop <= len(staged_k) and kernel.takes(q, staged_k, staged_v, p.mask)
               for p in pieces)
    if not (fits and kernel.takes(q, k, v, None)):
        return None
    return kernel.pieces(q, k, v, staged_k, staged_v, pieces, scale)
