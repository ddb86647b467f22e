"""Model files outside the serving core: checkpoints (GGUF, Hugging Face) into a
``Transformer`` with the weight class of each tensor, and the Hugging Face tokenizer.
:func:`load` is the loader :func:`slimkv.plugins.build_engine` hands the engine
(:class:`slimkv.model.protocol.ModelLoader`)."""

from slimkv.model_io.loader import (default_model_path, load, load_model, load_tokenizer,
                                    read_model_args)
from slimkv.model_io.tokenizer import Tokenizer

__all__ = ["Tokenizer", "default_model_path", "load", "load_model", "load_tokenizer",
           "read_model_args"]
