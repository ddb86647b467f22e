"""The routing keys of a prompt: chained hashes of its first full KV blocks.

They are the engine's own block hashes (``hash_block``, the prefix-cache key), so "replica
R holds blocks h1..hk" means the same thing to the router as to R's prefix cache. This
module is the one place that names the hash function; it is stable across processes, so
every ingress computes the same keys.
"""

from __future__ import annotations

from collections.abc import Sequence

from slimkv.kv.block_pool import BlockHash, hash_block


def routing_hashes(token_ids: Sequence[int], block_size: int,
                   max_blocks: int) -> tuple[BlockHash, ...]:
    """One hash per full block of the prompt's first ``max_blocks`` blocks
    (``cluster.routing_blocks``), chained: the i-th value depends on every token before the
    end of block i."""
    out: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size, block_size):
        parent = hash_block(parent, token_ids[start:start + block_size])
        out.append(parent)
    return tuple(out)
