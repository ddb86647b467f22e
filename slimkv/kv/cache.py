"""The preallocated paged KV pool.

For each of K and V, every field of its codec (``data`` and each per-token auxiliary tensor
such as ``scale``/``zero``) is one tensor ``[num_layers, num_blocks, block_size, num_kv_heads,
width]`` allocated once at start-up; per-block auxiliary tensors (per-channel key scales)
are ``[num_layers, num_blocks, num_kv_heads, width]``. Token ``offset`` of block ``b`` lives
at slot ``b * block_size + offset``. Reads gather and dequantize only the requested blocks.
With ``layer_dtypes`` (per-layer mixed precision, :mod:`slimkv.kv.layers`) the layers of each
dtype have their own tensors, whose leading axis runs over those layers only.

A codec with per-block scales can only quantize full blocks: such a cache takes whole
blocks only (:meth:`PagedKVCache.write_blocks`), from the staging slots in front of it
(:mod:`slimkv.kv.staging`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from slimkv.config import INT4_GROUP
from slimkv.kv.layers import LayerDtypes, layer_codecs, side_codec, side_codecs
from slimkv.kv.quant import AUX_DTYPE, KVCodec, QuantizedKV
from slimkv.stats import cdiv

_SIDES = ("k", "v")

__all__ = ["PagedKVCache", "side_codec"]


@dataclass(slots=True)
class _LayerGroup:
    """Layers sharing one K codec and one V codec: one pool per side whose leading axis runs
    over ``layers``."""

    layers: list[int]
    codecs: dict[str, KVCodec]
    pools: dict[str, QuantizedKV]


class PagedKVCache:
    """All layers' K and V blocks in their (possibly quantized) storage formats.

    ``layer_dtypes`` (see :mod:`slimkv.kv.layers`) gives some layers another dtype than
    ``k_dtype``/``v_dtype``; layers with the same codecs share one pool per side.
    ``codecs`` are the default layers' codecs, ``layer_codecs[layer]`` each layer's.
    """

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, k_dtype: str, v_dtype: str, k_scale: str, device: torch.device,
                 layer_dtypes: LayerDtypes | None = None, int4_group_size: int = INT4_GROUP) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.k_scale, self.layer_dtypes = k_scale, layer_dtypes
        self.int4_group_size = int4_group_size
        self.codecs = side_codecs(k_dtype, v_dtype, head_dim, k_scale, int4_group_size)
        self.layer_codecs = layer_codecs(num_layers, head_dim, k_dtype, v_dtype, k_scale,
                                         layer_dtypes, int4_group_size)
        self._groups = self._group_layers()
        self._where = {layer: (group, i) for group in self._groups
                       for i, layer in enumerate(group.layers)}
        self.block_scaled = any(codec.block_aux_widths for codec in self.all_codecs())
        self.writer: Any = None  # writes in kernels instead (CUDA: kernels/triton/pool.py)

    def _group_layers(self) -> list[_LayerGroup]:
        """One group per distinct codec pair (``layer_codecs`` shares one dict per pair)."""
        groups: dict[int, _LayerGroup] = {}
        for layer, codecs in enumerate(self.layer_codecs):
            group = groups.setdefault(id(codecs), _LayerGroup([], codecs, {}))
            group.layers.append(layer)
        for group in groups.values():
            group.pools = {side: self._allocate(codec, len(group.layers))
                           for side, codec in group.codecs.items()}
        return list(groups.values())

    def _allocate(self, codec: KVCodec, num_layers: int) -> QuantizedKV:
        lead = (num_layers, self.num_blocks)
        heads = (self.num_kv_heads,)
        tokens = (self.block_size, self.num_kv_heads)
        data = torch.zeros((*lead, *tokens, codec.data_width), dtype=codec.storage_dtype,
                           device=self.device)
        # Scales start at 1 so never-written slots dequantize to finite values.
        aux = {name: torch.ones((*lead, *tokens, width), dtype=AUX_DTYPE, device=self.device)
               for name, width in codec.aux_widths.items()}
        aux.update({name: torch.ones((*lead, *heads, width), dtype=AUX_DTYPE, device=self.device)
                    for name, width in codec.block_aux_widths.items()})
        return QuantizedKV(data, aux)

    # -- sizing -------------------------------------------------------------------------

    @staticmethod
    def block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, k_dtype: str,
                    v_dtype: str, k_scale: str, block_size: int,
                    layer_dtypes: LayerDtypes | None = None, int4_group_size: int = INT4_GROUP) -> int:
        """Exact bytes of one block across all layers, K and V, scales and zeros included:
        the sum of every layer's own figure."""
        codecs = layer_codecs(num_layers, head_dim, k_dtype, v_dtype, k_scale, layer_dtypes,
                              int4_group_size)
        per_head = sum(codec.bytes_per_block_head(block_size)
                       for layer in codecs for codec in layer.values())
        return num_kv_heads * per_head

    @classmethod
    def bytes_per_token(cls, **shape: Any) -> float:
        """Bytes one token occupies in the pool: :meth:`block_bytes` (same arguments) /
        ``block_size`` (an integer whenever per-block scales divide evenly; staging is not
        per token, see :meth:`slimkv.kv.staging.Staging.bytes`)."""
        per_block, block_size = cls.block_bytes(**shape), shape["block_size"]
        return per_block // block_size if per_block % block_size == 0 else per_block / block_size

    @classmethod
    def num_blocks_for_budget(cls, budget_bytes: int, reserved_bytes: int = 0, **shape: Any) -> int:
        """How many blocks of :meth:`block_bytes` (same arguments) fit in ``budget_bytes``
        less ``reserved_bytes`` (staging), floor."""
        return max(0, budget_bytes - reserved_bytes) // cls.block_bytes(**shape)

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes(self.num_layers, self.num_kv_heads, self.head_dim,
                                self.codecs["k"].name, self.codecs["v"].name, self.k_scale,
                                self.block_size, self.layer_dtypes, self.int4_group_size)

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated, summed over every pool tensor (staging apart)."""
        return sum(t.nbytes for t in self.tensors().values())

    def all_codecs(self) -> list[KVCodec]:
        """Every distinct codec the cache stores (K and V of every layer group)."""
        return [codec for group in self._groups for codec in group.codecs.values()]

    def tensors(self) -> dict[str, Tensor]:
        """Every pool tensor (staging apart) by name (``k_data``, ``k_scale``, ``v_zero``, ...);
        with several layer groups the names end in the group's dtypes, ``k_data[int8]``."""
        named = {}
        for group in self._groups:
            tag = "" if len(self._groups) == 1 else f"[{self._tag(group)}]"
            for side, pool in group.pools.items():
                named[f"{side}_data{tag}"] = pool.data
                named.update({f"{side}_{name}{tag}": t for name, t in pool.aux.items()})
        return named

    @staticmethod
    def _tag(group: _LayerGroup) -> str:
        k, v = (group.codecs[side].name for side in _SIDES)
        return k if k == v else f"{k}/{v}"

    # -- access -------------------------------------------------------------------------

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        """Quantize ``k``/``v`` ``[T, H, D]`` and store token ``t`` at ``slot_mapping[t]``
        (per-token scales only: a cache with per-block scales takes whole blocks, see
        :meth:`write_blocks`)."""
        if self.block_scaled:
            raise RuntimeError("a cache with per-block scales is written block by block")
        if self.writer is not None:
            return self.writer.write(layer, slot_mapping, k, v)
        for side, x in zip(_SIDES, (k, v)):
            encoded = self.layer_codecs[layer][side].quantize(x)
            for stored, new in self._fields(self.layer_pool(side, layer), encoded):
                stored.flatten(0, 1)[slot_mapping] = new

    def write_blocks(self, layer: int, block_ids: Tensor, k: Tensor, v: Tensor) -> None:
        """Quantize whole blocks ``k``/``v`` ``[n, block_size, H, D]`` into ``block_ids [n]``."""
        if self.writer is not None:
            return self.writer.write_blocks(layer, block_ids, k, v)
        for side, x in zip(_SIDES, (k, v)):
            encoded = self.layer_codecs[layer][side].quantize(x)
            for stored, new in self._fields(self.layer_pool(side, layer), encoded):
                stored[block_ids] = new

    def write_blocks_all_layers(self, block_ids: Tensor, k: Tensor, v: Tensor) -> None:
        """:meth:`write_blocks` of every layer at once, ``k``/``v`` ``[num_layers, n,
        block_size, H, D]``: one quantize per layer group (codecs reduce within a block,
        so this stores what layer-by-layer writes store)."""
        for group in self._groups:
            layers = group.layers if len(group.layers) < self.num_layers else slice(None)
            for side, x in zip(_SIDES, (k, v)):
                encoded = group.codecs[side].quantize(x[layers])
                for stored, new in self._fields(group.pools[side], encoded):
                    stored[:, block_ids] = new

    def copy_block(self, src: int, dst: int) -> None:
        """Pool block ``src``'s content (every layer, data and scales) into block ``dst``."""
        for t in self.tensors().values():
            t[:, dst] = t[:, src]

    def layer_pool(self, side: str, layer: int) -> QuantizedKV:
        """Views of one layer's tensors of side ``k`` or ``v`` (for native kernels)."""
        group, index = self._where[layer]
        pool = group.pools[side]
        return QuantizedKV(pool.data[index], {name: t[index] for name, t in pool.aux.items()})

    def read(self, layer: int, block_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Dequantized K and V of the given blocks: ``[..., n] -> [..., n * block_size, H, D]``."""
        return tuple(self._read_side(side, layer, block_ids, dtype) for side in _SIDES)

    def read_prefix(self, layer: int, block_tables: Tensor, num_tokens: int,
                    dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """:meth:`read` of just the first blocks of ``block_tables [B, m]`` that cover
        ``num_tokens`` tokens: ``[B, num_blocks * block_size, H, D]``."""
        return self.read(layer, block_tables[:, :cdiv(num_tokens, self.block_size)], dtype)

    def _read_side(self, side: str, layer: int, block_ids: Tensor, dtype: torch.dtype) -> Tensor:
        pool = self.layer_pool(side, layer)
        gathered = QuantizedKV(pool.data[block_ids],
                               {name: t[block_ids] for name, t in pool.aux.items()})
        return self.layer_codecs[layer][side].dequantize(gathered, dtype).flatten(-4, -3)

    @staticmethod
    def _fields(pool: QuantizedKV, encoded: QuantizedKV) -> list[tuple[Tensor, Tensor]]:
        """(pool tensor, new values) pairs for data and every auxiliary field."""
        return [(pool.data, encoded.data)] + [(pool.aux[n], encoded.aux[n]) for n in pool.aux]

    def __repr__(self) -> str:
        mix = f", layer_dtypes={dict(self.layer_dtypes)}" if self.layer_dtypes else ""
        return (f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, k={self.codecs['k'].name}, "
                f"v={self.codecs['v'].name}{mix}, {self.nbytes / 2**20:.1f} MiB)")
