"""An engine with the package's plug-ins: what the core calls through a small protocol but
never imports (``tests/test_size.py`` checks it). Build engines from a config here.

- ``kv_cache.offload``: the offload tier (:mod:`slimkv.kv.offload`) as the engine's KV
  connector (:class:`~slimkv.kv.connector.KVConnector`).
"""

from __future__ import annotations

from slimkv.config import Config
from slimkv.engine import LLMEngine
from slimkv.kv.offload import offload_connector


def build_engine(config: Config) -> LLMEngine:
    """``LLMEngine(config)`` with every plug-in its config may ask for."""
    return LLMEngine(config, connector=offload_connector)
