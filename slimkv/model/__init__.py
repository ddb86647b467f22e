"""Model definition, checkpoint loading and tokenization."""

from slimkv.model.llama import AttentionFn, ModelArgs, Transformer
from slimkv.model.loader import default_model_path, load_model
from slimkv.model.tokenizer import Tokenizer

__all__ = ["AttentionFn", "ModelArgs", "Tokenizer", "Transformer", "default_model_path",
           "load_model"]
