"""Where the engine's model comes from, as the core sees it: a :class:`ModelLoader` and the
:class:`Tokenizer` it returns.

The core never reads a checkpoint file: the engine's builder hands it a loader
(:func:`slimkv.plugins.build_engine` passes :func:`slimkv.model_io.load`, GGUF and Hugging
Face checkpoints with their Hugging Face tokenizer), as it hands it the KV connector.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from slimkv.config import Config
    from slimkv.model.llama import ModelArgs, Transformer


class Tokenizer(Protocol):
    """The calls the engine, its outputs and the server make on a tokenizer."""

    name: str
    eos_token_ids: frozenset[int]   # any of them ends generation (unless ``ignore_eos``)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A prompt's ids (the tokenizer decides about BOS)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``ids``, special tokens skipped unless asked otherwise."""

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (special tokens included), for log-probabilities."""

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict] | None = None, **options: Any) -> list[int]:
        """The prompt ids of a chat, with OpenAI ``tools`` (``ValueError`` when the model
        has no template); ``options``: ``add_generation_prompt``,
        ``continue_final_message``, template variables."""


class ModelLoader(Protocol):
    def __call__(self, config: Config, device: torch.device,
                 dtype: torch.dtype) -> tuple[ModelArgs, Transformer, Tokenizer]:
        """``config.model``'s shapes, its decoder on ``device`` in ``dtype`` (weights in the
        class ``model.weights`` asks for; not to be mutated: loaders may cache it) and its
        tokenizer. A decoder marked ``v_rotated = True`` has ``kv_cache.int4.rotate_v``
        folded into its weights (in the layers whose V is int4; see
        :mod:`slimkv.model_io.rotate`), so the attention does not rotate V again."""
