"""A second KV tier below the pool: chunks of full blocks in host memory and on disk,
loaded instead of recomputed (see :mod:`slimkv.kv.offload.tier`)."""

from __future__ import annotations

import atexit
import os
from typing import Any

from slimkv.kv.offload.chunk import ChunkLayout, model_digest
from slimkv.kv.offload.config import OffloadConfig
from slimkv.kv.offload.tier import OffloadTier
from slimkv.model import default_model_path


def attach_offload(engine: Any) -> OffloadTier:
    """The tier of ``engine.config.kv_cache.offload``, wired to the engine's pool (its
    evictions write back) and KV manager (its prefix matching loads). The tier stores what
    it has pending when the process exits (or on :meth:`OffloadTier.close`)."""
    config = OffloadConfig.of(engine.config.kv_cache)
    runner = engine.runner
    path = os.path.realpath(engine.config.model.path or default_model_path())
    layout = ChunkLayout(runner.cache, model_digest(path), str(runner.dtype).removeprefix("torch."))
    tier = OffloadTier(layout, config, pin=runner.device.type == "cuda")
    tier.attach(engine.pool)
    engine.manager.tier = tier
    atexit.register(tier.close)
    return tier
