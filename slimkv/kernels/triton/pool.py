"""The paged pool's writes through the Triton kernels (``PagedKVCache.writer`` on CUDA).

:meth:`PagedKVCache.write` (a step's tokens, per-token scales) and
:meth:`PagedKVCache.write_blocks` (whole blocks: a staged block that filled, or a prefill's
full blocks, keys with per-channel-block scales) call this instead of quantizing with torch
ops and scattering field by field: one kernel launch per layer call each, codes and scales
bit for bit the codecs' (:mod:`slimkv.kernels.triton.write`).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from slimkv.kernels.triton.side import TritonSide, describe
from slimkv.kernels.triton.write import store_blocks, write_tokens


class TritonPoolWriter:
    """Writes into ``cache``'s pool; the layers' :class:`TritonSide` views made on first use."""

    def __init__(self, cache) -> None:
        # The cache holds its writer: a strong reference back would make a cycle that only
        # the cyclic collector frees, keeping the whole pool on the device until it runs.
        self._cache = weakref.ref(cache)
        self._sides: dict[int, tuple[TritonSide, TritonSide]] = {}

    def sides(self, layer: int) -> tuple[TritonSide, TritonSide]:
        if layer not in self._sides:
            cache = self._cache()
            self._sides[layer] = tuple(describe(cache.layer_codecs[layer][side],
                                                cache.layer_pool(side, layer))
                                       for side in ("k", "v"))
        return self._sides[layer]

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        """``k``/``v [T, H, D]``: token ``t`` at ``slot_mapping[t]``."""
        write_tokens(*self.sides(layer), k, v, slot_mapping)

    def write_blocks(self, layer: int, block_ids: Tensor, k: Tensor, v: Tensor) -> None:
        """Whole blocks ``k``/``v [n, block_size, H, D]`` into ``block_ids [n]``."""
        slots = torch.arange(len(block_ids), device=block_ids.device)
        store_blocks(*self.sides(layer), k.contiguous(), v.contiguous(), slots, block_ids)
