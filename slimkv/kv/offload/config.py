"""``kv_cache.offload``: the one source of the offload tier's settings and defaults.

The section is kept as a mapping in :class:`~slimkv.config.KVCacheConfig` (the tier lives
below the config layer) and validated here when the engine starts, with the same rules and
messages as every other section: an unknown key names its full path."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from slimkv.config import (ConfigError, KVCacheConfig, _check, _check_choice, _check_int,
                           _check_positive, _reject_unknown)

OFFLOAD_WRITES = ("evict", "idle", "through")


@dataclass(slots=True)
class OffloadConfig:
    """``host_gb`` of host memory, then ``disk_gb`` under ``disk_path`` (no disk tier when
    None). ``write: evict`` stores a chunk when the pool evicts it; ``idle`` also stores the
    chunks of sequences idle for ``idle_s``; ``through`` stores every new chunk of a sequence
    when it frees its blocks (each finished turn), on disk too (not only in host memory), so
    other processes sharing ``disk_path`` (cluster replicas, a restart after a crash) find
    it: the default of a cluster's replicas with a ``disk_path`` (slimkv/cluster/replica.py).
    ``queue_chunks``: the writer's queue (a chunk arriving when it is full is dropped and
    counted)."""

    host_gb: float = 4.0
    disk_path: str | None = None
    disk_gb: float = 50.0
    write: str = "evict"
    idle_s: float = 30.0
    queue_chunks: int = 64

    def __post_init__(self) -> None:
        for key in ("host_gb", "disk_gb", "idle_s"):
            _check_positive(getattr(self, key), f"kv_cache.offload.{key}", inclusive=True)
        _check(self.host_gb > 0 or self.disk_path is not None, "kv_cache.offload",
               "set host_gb > 0 or a disk_path")
        _check_choice(self.write, OFFLOAD_WRITES, "kv_cache.offload.write")
        _check_int(self.queue_chunks, "kv_cache.offload.queue_chunks")

    @classmethod
    def of(cls, kv: KVCacheConfig) -> OffloadConfig:
        """The validated ``kv_cache.offload`` section of ``kv``."""
        values: Any = kv.offload
        if isinstance(values, cls):
            return values
        _check(isinstance(values, dict), "kv_cache.offload", "must be a mapping")
        _reject_unknown(values, {f.name for f in fields(cls)}, "kv_cache.offload.")
        if not (kv.paged and kv.enable_prefix_caching):
            raise ConfigError("kv_cache.offload: needs a paged KV cache with prefix caching")
        return cls(**values)
