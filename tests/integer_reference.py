"""The fused decode kernel's integer math (AVX512-VNNI, slimkv/kernels/paged_decode_vnni.h),
written independently in torch, with the error bounds that math carries.

Where the kernel runs it (``paged_decode_integer_for(D)``), pool blocks of int8 keys and of
block-scaled int4 keys meet an int16-quantized query, and per-token-scaled int8 values
int16-quantized softmax weights:

- Q.K: per block, KV head and query head, ``qs`` (q * sm_scale, times the block's channel
  scales when folded) becomes ``q16 = round(qs / a)``, ``a = max|qs| / 32767`` (float32
  ops, round half to even); the score is ``a * (q16 . raw) * row_scale + q.zero`` with the
  dot exact in integers (``raw``: the stored int8 values or int4 levels).
- P.V: per 16-token tile of a block and query head, ``w = p * row_scale`` becomes
  ``w16 = round(w / b)``, ``b = max w / 32767``; the tile adds ``b * (w16 . raw)``.

Bounds against the float reference (all quantities from the stored data):

- q rounding moves a score by at most ``eps_t = a / 2 * sum_d |raw_td| * row_scale_t``.
  Scores all moved by at most ``eps`` change every softmax weight by a factor within
  ``exp(+-2 eps)``, so the output moves by at most ``(exp(2 eps) - 1) * max_t |v_t - o|``
  (the weights sum to one on both sides, so ``sum_t (pi'_t - pi_t) v_t`` equals
  ``sum_t (pi'_t - pi_t) (v_t - o)``).
- w rounding moves a tile's sum by at most ``b / 2 * sum_t |raw_td|`` per channel, divided
  by the softmax denominator.

Against this same math the kernel differs by float rounding only, except that its softmax
weights come from its own exp polynomial and split-K maxima: ulps apart from torch's, which
can flip ``round(w / b)`` by one where ``w / b`` lies within a hair of a half. Such weights
(within ``FLIP`` of a half: a relative change of ``FLIP / 32767``, hundreds of ulps) are
counted as uncertain: each adds ``b * max_d |raw_td|`` to that row's bound.
"""

from __future__ import annotations

import ctypes
import math

import torch
from torch import Tensor

from slimkv import kernels
from slimkv.kernels import build
from slimkv.attention import AttentionMetadata, reference_paged_attention, sequence_context
from slimkv.kv.cache import PagedKVCache
from slimkv.kv.staging import Staging

STEPS, TILE, FLIP = 32767, 16, 0.01
FLOAT_TOL = 1e-5  # the kernel tests' float bound (rtol and atol)
_I8, _U4, _TOKEN, _BLOCK = 3, 6, 1, 2


def integer_sides(cache: PagedKVCache, layer: int) -> tuple[bool, bool]:
    """(keys, values) of ``layer`` that the built kernel computes with integer dots."""
    lib = build.load(kernels.SOURCE)
    if isinstance(lib, str):  # no kernel: decodes run on SDPA
        return False, False
    fn = lib.paged_decode_integer_for
    fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
    if not fn(cache.head_dim):
        return False, False
    (k_kind, k_mode, _), (v_kind, v_mode, _) = (
        kernels.kernel_format(cache.layer_codecs[layer][s]) for s in "kv")
    keys = k_kind == _I8 and k_mode in (_TOKEN, _BLOCK) or k_kind == _U4 and k_mode == _BLOCK
    return keys, v_kind == _I8 and v_mode == _TOKEN


def _quantize(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(int16 levels as int64, step, x / step) of float32 ``x`` along its last dim."""
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(float(STEPS)) / amax, torch.zeros_like(amax))
    scaled = x * inv
    return scaled.round().clamp(-STEPS, STEPS).long(), amax / STEPS, scaled


def _raw(cache: PagedKVCache, side: str, layer: int, block: int) -> tuple[Tensor, dict]:
    """Stored integers ``[bs, H, D]`` (int64, int4 unpacked to levels) and aux of a block."""
    pool = cache.layer_pool(side, layer)
    data = pool.data[block]
    raw = torch.stack((data & 15, data >> 4), -1).flatten(-2) if data.dtype == torch.uint8 \
        else data
    return raw.long(), {name: t[block].float() for name, t in pool.aux.items()}


def _sequence(cache, layer, q, meta, i, scale, staging, keys_int, values_int):
    """Decode i (its query row of q): (out [Hq, D], bound vs float [Hq], bound vs this math
    [Hq])."""
    bs, H, D = cache.block_size, cache.num_kv_heads, cache.head_dim
    L, G = meta.seq_lens[i], q.shape[0] // H
    own = (L - 1) // bs if staging is not None else -1
    k, v, mask = sequence_context(cache, staging, layer, meta, i, torch.float32)
    k, v = k[0, mask[0, -1]], v[0, mask[0, -1]]  # [L, H, D]: the reference's values
    qp = (q.float() * torch.tensor(scale, dtype=torch.float32)).view(H, G, D)
    scores = torch.einsum("hgd,thd->hgt", qp, k)
    eps = torch.zeros(H, G)
    table = meta.block_tables[i]
    for j in range(-(-L // bs)):
        if j == own or not keys_int:
            continue
        t = slice(j * bs, min(L, (j + 1) * bs))
        raw, aux = _raw(cache, "k", layer, int(table[j]))
        raw = raw[:t.stop - t.start]
        row_scale = torch.ones(raw.shape[0], H)
        qs, bias = qp, torch.zeros(H, G, 1)
        if aux["scale"].dim() == 2:  # per (head, channel) of the block: folded into q
            qs = qp * aux["scale"][:, None, :]
            if "zero" in aux:
                bias = (qp * aux["zero"][:, None, :]).sum(-1, keepdim=True)
        else:
            row_scale = aux["scale"][:raw.shape[0], :, 0]
        q16, a, _ = _quantize(qs)
        dots = torch.einsum("hgd,thd->hgt", q16, raw).float()
        scores[:, :, t] = dots * (a * row_scale.T[:, None, :]) + bias
        eps_t = a / 2 * raw.abs().sum(-1).T[:, None, :] * row_scale.T[:, None, :]
        eps = torch.maximum(eps, eps_t.amax(-1))
    p = (scores - scores.amax(-1, keepdim=True)).exp()
    acc = torch.einsum("hgt,thd->hgd", p, v)
    v_err, unsure = torch.zeros(H, G, D), torch.zeros(H, G)
    for j in range(-(-L // bs)):
        if j == own or not values_int:
            continue
        raw_block, aux = _raw(cache, "v", layer, int(table[j]))
        for t0 in range(0, min(bs, L - j * bs), TILE):
            t = slice(j * bs + t0, min(L, j * bs + t0 + TILE, (j + 1) * bs))
            raw = raw_block[t0:t0 + t.stop - t.start]  # [n, H, D]
            w = p[:, :, t] * aux["scale"][t0:t0 + raw.shape[0], :, 0].T[:, None, :]
            w16, b, scaled = _quantize(w)
            acc -= torch.einsum("hgt,thd->hgd", p[:, :, t], v[t])
            acc += b * torch.einsum("hgt,thd->hgd", w16, raw).float()
            v_err += b / 2 * raw.abs().sum(0)[:, None, :]
            near = ((scaled - scaled.floor()) - 0.5).abs() < FLIP
            unsure += (near * b * raw.abs().amax(-1).T[:, None, :]).sum(-1)
    total = p.sum(-1, keepdim=True)
    out = acc / total
    spread = (v[:, :, None, :] - out[None]).abs().amax(0).amax(-1)  # [H, G]
    bound = (torch.exp(2 * eps) - 1) * spread + (v_err / total).amax(-1)
    return out.reshape(H * G, D), bound.reshape(-1), (unsure / total[..., 0]).reshape(-1)


def integer_reference(cache: PagedKVCache, layer: int, q: Tensor, meta: AttentionMetadata,
                      scale: float, staging: Staging | None, keys_int: bool, values_int: bool,
                      reference: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``q [rows, Hq, D]``: (the kernel's math's output, its bound against the float
    reference, its allowance for flipped weights against the kernel), ``[rows, Hq(, D)]``.
    Prefill rows (not the kernel's) keep the float ``reference`` with bounds 0."""
    out, bound = reference.float().clone(), torch.zeros(reference.shape[:2])
    unsure = torch.zeros(reference.shape[:2])
    for i, row in enumerate(meta.query_start_loc[:-1]):
        if meta.query_lens[i] == 1:
            out[row], bound[row], unsure[row] = _sequence(cache, layer, q[row], meta, i, scale,
                                                          staging, keys_int, values_int)
    return out, bound, unsure


def assert_kernel_matches(fused: Tensor, cache: PagedKVCache, layer: int, q: Tensor,
                          meta: AttentionMetadata, scale: float, staging: Staging | None,
                          others: tuple[Tensor, ...] = ()) -> None:
    """The kernel's output against the float reference (and ``others``: float paths) at the
    float bound, or, where the kernel uses integer dots, against this math at the float bound
    plus the flip allowance, and against the float ones within the derived bound."""
    reference = reference_paged_attention(cache, layer, q, meta, scale, torch.float32, staging)
    keys_int, values_int = integer_sides(cache, layer)
    if not (keys_int or values_int):
        for expected in (*others, reference):
            torch.testing.assert_close(fused, expected, rtol=FLOAT_TOL, atol=FLOAT_TOL)
        return
    same, bound, unsure = integer_reference(cache, layer, q, meta, scale, staging, keys_int,
                                            values_int, reference)
    fused = fused.float()
    tol = FLOAT_TOL + FLOAT_TOL * same.abs()
    assert ((fused - same).abs() <= tol + unsure[..., None]).all(), \
        f"kernel vs its integer math: {(fused - same).abs().max():.3g}"
    for expected in (*others, reference):
        err = (fused - expected).abs()
        allowed = FLOAT_TOL + FLOAT_TOL * expected.abs() + bound[..., None]
        assert (err <= allowed).all(), f"{err.max():.3g} beyond the bound {bound.max():.3g}"
    assert math.isfinite(float(bound.max()))
