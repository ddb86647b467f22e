"""An engine with the package's plug-ins: what the core calls through a small protocol but
never imports (``tests/test_size.py`` checks it). Build engines from a config here.

- the OpenAI sampling options (logprobs, penalties, ``logit_bias``, ``min_tokens``,
  structured output): logits processors (:mod:`slimkv.options`) for the sampler;
- ``kv_cache.offload``: the offload tier (:mod:`slimkv.kv.offload`) as the engine's KV
  connector (:class:`~slimkv.kv.connector.KVConnector`);
- the model files: GGUF / Hugging Face checkpoints and tokenizers (:mod:`slimkv.model_io`)
  as the engine's loader (:class:`~slimkv.model.protocol.ModelLoader`);
- ``kv_cache.paged: false``: the contiguous baseline (:mod:`slimkv.kv.contiguous`) as the
  engine's KV manager;
- the kernel backends of attention (:mod:`slimkv.backends`: the fused C kernels and the
  one-call decode step on the CPU, Triton on CUDA), among which the engine chooses once.
"""

from __future__ import annotations

from slimkv.backends import KERNELS
from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.kv.contiguous import ContiguousKVManager
from slimkv.kv.offload import offload_connector
from slimkv.model_io import load
from slimkv.options import logits_processors


def build_engine(config: Config) -> LLMEngine:
    """``LLMEngine(config)`` with every plug-in its config may ask for."""
    return LLMEngine(config, load, processors=logits_processors, connector=offload_connector,
                     contiguous=ContiguousKVManager, kernels=KERNELS)
