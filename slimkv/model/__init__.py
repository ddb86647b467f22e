"""The model: the Llama-family decoder and its quantized weights; what loads it, as the core
sees it (:mod:`slimkv.model.protocol`). Checkpoint files and tokenizers are read outside
the core (:mod:`slimkv.model_io`)."""

from slimkv.model.llama import AttentionFn, ModelArgs, Transformer

__all__ = ["AttentionFn", "ModelArgs", "Transformer"]
