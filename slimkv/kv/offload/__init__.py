"""A second KV tier below the pool: chunks of full blocks in host memory and on disk,
loaded instead of recomputed (see :mod:`slimkv.kv.offload.tier`). A plug-in: it serves the
engine as its :class:`~slimkv.kv.connector.KVConnector`, and the core never imports it."""

from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING

from slimkv.config import ConfigError
from slimkv.kv.offload.chunk import ChunkLayout, model_digest
from slimkv.kv.offload.config import OffloadConfig
from slimkv.kv.offload.tier import OffloadTier
from slimkv.model_io import default_model_path

if TYPE_CHECKING:
    from slimkv.engine.runner import ModelRunner


def offload_connector(runner: ModelRunner) -> OffloadTier:
    """The tier of ``runner.config.kv_cache.offload`` over the runner's KV pool (the engine
    attaches it to its block pool and KV manager). The tier stores what it has pending when
    the process exits (or on :meth:`OffloadTier.close`)."""
    config = runner.config
    if runner.num_sink:  # its chunks are the quantized pool's bytes: a sink block's are stale
        raise ConfigError("kv_cache.offload does not store the float sink block of "
                          "kv_cache.int4.sink_block: set one of them off (sink_block: false)")
    offload = OffloadConfig.of(config.kv_cache)
    path = os.path.realpath(config.model.path or default_model_path())
    int4 = config.kv_cache.int4
    layout = ChunkLayout(runner.cache, model_digest(path), str(runner.dtype).removeprefix("torch."),
                         (int4.rotate_k, int4.rotate_v))
    tier = OffloadTier(layout, offload, pin=runner.device.type == "cuda")
    atexit.register(tier.close)
    return tier
