"""A KV store below the pool, as the core sees it (vLLM's KV connector, LMCache's idea).

The core talks to it through these few calls and never imports an implementation: the
engine's builder makes one from the config (``kv_cache.offload``: :mod:`slimkv.plugins`
builds :mod:`slimkv.kv.offload`) and hands the engine a factory for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from slimkv.kv.block_pool import Block, BlockHash, BlockPool


class KVConnector(Protocol):
    def attach(self, pool: BlockPool) -> None:
        """Serve ``pool``: its evictions (``pool.on_evict``) may write back here."""

    def load(self, hashes: Sequence[BlockHash], hits: list[Block]) -> list[Block]:
        """Blocks loaded into the pool for the chain ``hashes`` past its pool ``hits``
        (prefix-cached, reference count 0); a lookup at admission."""

    def save(self, hashes: Sequence[BlockHash]) -> None:
        """A sequence freed blocks with these chained hashes: keep what is worth keeping."""

    def stats(self) -> Mapping[str, object]:
        """What it reports in :attr:`EngineStats.offload`, by tier."""

    def close(self) -> None:
        """Store what is pending and stop (idempotent)."""
