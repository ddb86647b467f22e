"""What the offload tier stores: a *chunk*, the bytes of ``CHUNK_BLOCKS`` full blocks
exactly as the pool holds them (every layer's K and V data, scales and zeros).

A chunk's payload is one flat ``uint8`` tensor: for each pool tensor in
:meth:`PagedKVCache.tensors` order, its ``[num_layers, CHUNK_BLOCKS, ...]`` slice of the
chunk's blocks, raw. Reading it back writes the same bytes into (other) blocks of the pool,
so a reloaded block is bit-identical to the one that was evicted.

The last chunk of a sequence may be *partial* (fewer blocks, the payload padded to full
size), so a session's tail is stored too. A chunk is keyed by the chained hash of its last
block (:func:`hash_block`, which names the
whole prefix) mixed with the *format digest*: the model file, the model dtype, the block
size and every pool tensor's name, dtype and shape, so a key from another model or KV format
never matches. Both are stable (blake2b), the same in every process and on every replica.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence

import torch
from torch import Tensor

from slimkv.kv.block_pool import BlockHash
from slimkv.kv.cache import PagedKVCache

CHUNK_BLOCKS = 16      # blocks per chunk: 256 tokens with the default block size
FORMAT_VERSION = 1     # bump when the payload layout changes
_READ_SIZE = 1 << 22


@functools.lru_cache(maxsize=8)
def model_digest(path: str) -> bytes:
    """blake2b-128 of a model's weights: a GGUF file, or a directory's files in name order
    (config and tokenizer included, since they change the KV too)."""
    files = ([os.path.join(path, name) for name in sorted(os.listdir(path))]
             if os.path.isdir(path) else [path])
    digest = hashlib.blake2b(digest_size=16)
    for name in files:
        if not os.path.isfile(name):
            continue
        digest.update(os.path.basename(name).encode() + b"\0")
        with open(name, "rb") as f:
            while data := f.read(_READ_SIZE):
                digest.update(data)
    return digest.digest()


class ChunkLayout:
    """How a chunk of one :class:`PagedKVCache` is laid out in bytes: gather and scatter."""

    def __init__(self, cache: PagedKVCache, model_id: bytes, model_dtype: str,
                 rotation: tuple[bool, bool] = (False, False)) -> None:
        """``rotation``: kv_cache.int4's (rotate_k, rotate_v), which change what int4 layers
        store without changing their codecs, so they are part of the format digest."""
        self.cache, self.rotation = cache, rotation
        self.tensors = list(cache.tensors().items())
        # Bytes of one block's slice of each tensor (all layers of its group).
        self._sizes = [t[:, :1].nbytes for _, t in self.tensors]
        self.num_bytes = CHUNK_BLOCKS * sum(self._sizes)
        self.format_digest = self._digest(model_id, model_dtype)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    def _digest(self, model_id: bytes, model_dtype: str) -> bytes:
        spec = {"version": FORMAT_VERSION, "chunk_blocks": CHUNK_BLOCKS,
                "block_size": self.cache.block_size, "model_dtype": model_dtype,
                "layers": [(c["k"].name, type(c["k"]).__name__, c["v"].name,
                            type(c["v"]).__name__) for c in self.cache.layer_codecs],
                "tensors": [(name, str(t.dtype), t.shape[0], tuple(t.shape[2:]))
                            for name, t in self.tensors]}
        if any(self.rotation):  # absent otherwise: the digests of existing tiers stay valid
            spec["rotation"] = list(self.rotation)
        data = json.dumps(spec, sort_keys=True).encode()
        return hashlib.blake2b(data, digest_size=16, key=model_id[:64]).digest()

    def key(self, last_block_hash: BlockHash) -> bytes:
        """The chunk's key: its last block's chained hash under this format."""
        return hashlib.blake2b(last_block_hash, digest_size=16,
                               key=self.format_digest).digest()

    def gather(self, block_ids: Sequence[int]) -> Tensor:
        """The payload of the chunk held in ``block_ids`` (at most ``CHUNK_BLOCKS``; a
        shorter, *partial* chunk repeats its last block to full size), a contiguous
        ``uint8`` tensor on the CPU."""
        assert 0 < len(block_ids) <= CHUNK_BLOCKS
        padded = list(block_ids) + [block_ids[-1]] * (CHUNK_BLOCKS - len(block_ids))
        ids = torch.tensor(padded, dtype=torch.long, device=self.cache.device)
        parts = [t[:, ids].contiguous().view(-1).view(torch.uint8) for _, t in self.tensors]
        return torch.cat(parts).cpu()

    def scatter(self, payload: Tensor, block_ids: Sequence[int], first: int = 0) -> None:
        """Write chunk blocks ``first, first + 1, ...`` of ``payload`` into ``block_ids``."""
        assert first + len(block_ids) <= CHUNK_BLOCKS and payload.numel() == self.num_bytes
        ids = torch.tensor(block_ids, dtype=torch.long, device=self.cache.device)
        offset = 0
        for (_, t), size in zip(self.tensors, self._sizes):
            part = payload[offset:offset + size * CHUNK_BLOCKS]
            if offset % t.element_size():
                part = part.clone()  # a dtype view needs an aligned start
            offset += size * CHUNK_BLOCKS
            values = part.view(t.dtype).view(t.shape[0], CHUNK_BLOCKS, *t.shape[2:])
            t[:, ids] = values[:, first:first + len(block_ids)].to(t.device)
