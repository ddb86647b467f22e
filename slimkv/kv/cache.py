"""The preallocated paged KV pool.

For each of K and V, every field of its codec (``data`` and each auxiliary tensor such as
``scale``/``zero``) is one tensor ``[num_layers, num_blocks, block_size, num_kv_heads, width]``
allocated once at start-up. Token ``offset`` of block ``b`` lives at slot
``b * block_size + offset``. Reads gather and dequantize only the requested blocks.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slimkv.kv.quant import AUX_DTYPE, KVCodec, QuantizedKV, make_codec

_SIDES = ("k", "v")


class PagedKVCache:
    """All layers' K and V blocks in their (possibly quantized) storage formats."""

    def __init__(self, *, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, k_dtype: str, v_dtype: str, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.device = torch.device(device)
        self.codecs: dict[str, KVCodec] = {
            "k": make_codec(k_dtype, head_dim), "v": make_codec(v_dtype, head_dim)}
        self._pools = {side: self._allocate(codec) for side, codec in self.codecs.items()}

    def _allocate(self, codec: KVCodec) -> QuantizedKV:
        lead = (self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads)
        data = torch.zeros(*lead, codec.data_width, dtype=codec.storage_dtype, device=self.device)
        # Scales start at 1 so never-written slots dequantize to finite values.
        aux = {name: torch.ones(*lead, width, dtype=AUX_DTYPE, device=self.device)
               for name, width in codec.aux_widths.items()}
        return QuantizedKV(data, aux)

    # -- sizing -------------------------------------------------------------------------

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                        k_dtype: str, v_dtype: str) -> int:
        """Exact bytes one token occupies across all layers, K and V, scales included."""
        per_head = sum(make_codec(name, head_dim).bytes_per_token_head() for name in (k_dtype, v_dtype))
        return num_layers * num_kv_heads * per_head

    @classmethod
    def num_blocks_for_budget(cls, budget_bytes: int, block_size: int, *, num_layers: int,
                              num_kv_heads: int, head_dim: int, k_dtype: str, v_dtype: str) -> int:
        """How many blocks fit in ``budget_bytes`` (floor)."""
        per_token = cls.bytes_per_token(num_layers, num_kv_heads, head_dim, k_dtype, v_dtype)
        return budget_bytes // (block_size * per_token)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token(
            self.num_layers, self.num_kv_heads, self.head_dim,
            self.codecs["k"].name, self.codecs["v"].name)

    @property
    def nbytes(self) -> int:
        """Bytes actually allocated, summed over every pool tensor."""
        return sum(t.nbytes for t in self.tensors().values())

    def tensors(self) -> dict[str, Tensor]:
        """Every pool tensor by name (``k_data``, ``k_scale``, ``v_zero``, ...)."""
        named = {}
        for side, pool in self._pools.items():
            named[f"{side}_data"] = pool.data
            named.update({f"{side}_{name}": t for name, t in pool.aux.items()})
        return named

    # -- access -------------------------------------------------------------------------

    def write(self, layer: int, slot_mapping: Tensor, k: Tensor, v: Tensor) -> None:
        """Quantize ``k``/``v`` ``[T, H, D]`` and store token ``t`` at ``slot_mapping[t]``."""
        for side, x in zip(_SIDES, (k, v)):
            encoded = self.codecs[side].quantize(x)
            pool = self._pools[side]
            for stored, new in self._fields(pool, encoded):
                stored[layer].flatten(0, 1)[slot_mapping] = new

    def read(self, layer: int, block_ids: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Dequantized K and V of the given blocks: ``[..., n] -> [..., n * block_size, H, D]``."""
        k, v = (self._read_side(side, layer, block_ids, dtype) for side in _SIDES)
        return k, v

    def _read_side(self, side: str, layer: int, block_ids: Tensor, dtype: torch.dtype) -> Tensor:
        pool = self._pools[side]
        gathered = QuantizedKV(pool.data[layer][block_ids],
                               {name: t[layer][block_ids] for name, t in pool.aux.items()})
        return self.codecs[side].dequantize(gathered, dtype).flatten(-4, -3)

    @staticmethod
    def _fields(pool: QuantizedKV, encoded: QuantizedKV) -> list[tuple[Tensor, Tensor]]:
        """(pool tensor, new values) pairs for data and every auxiliary field."""
        return [(pool.data, encoded.data)] + [(pool.aux[n], encoded.aux[n]) for n in pool.aux]

    def __repr__(self) -> str:
        return (f"PagedKVCache(layers={self.num_layers}, blocks={self.num_blocks}, "
                f"block_size={self.block_size}, k={self.codecs['k'].name}, "
                f"v={self.codecs['v'].name}, {self.nbytes / 2**20:.1f} MiB)")
