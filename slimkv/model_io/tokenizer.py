"""Thin wrapper over a Hugging Face tokenizer with the few calls the engine needs."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from functools import cached_property
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from slimkv.model_io.chat_tools import serving_format, tool_template_inputs
from slimkv.options.tool_formats import ToolCallFormat, tokenizer_format

# End-of-turn / end-of-document markers that stop generation when a model's vocab has them.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")
_QUANT_SUFFIX = re.compile(r"[.-](?:i?q\d\w*|f\d+|bf16)$", re.IGNORECASE)  # ".Q4_1", "-f16"


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, name: str,
                 extra_eos: Iterable[int] = ()) -> None:
        self.hf = hf
        self.name = name
        self.vocab_size: int = len(hf)
        added = hf.get_added_vocab()  # special tokens live here even when not named as such
        stops = {added[t] for t in _STOP_TOKENS if t in added}
        eos = {hf.eos_token_id} if hf.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(eos | stops | set(extra_eos))

    @classmethod
    def from_gguf(cls, path: str) -> Tokenizer:
        """Convert the GGUF vocab (~4 s); transformers also takes ``tokenizer.chat_template``."""
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                           gguf_file=os.path.basename(path))
        stem = os.path.splitext(os.path.basename(path))[0]
        return cls(hf, _QUANT_SUFFIX.sub("", stem))

    @classmethod
    def from_dir(cls, path: str) -> Tokenizer:
        hf = AutoTokenizer.from_pretrained(path)
        return cls(hf, os.path.basename(os.path.normpath(path)), _declared_eos(path))

    @cached_property
    def tool_format(self) -> ToolCallFormat:
        """How this model writes tool calls (from its template and vocabulary)."""
        return serving_format(self.hf, tokenizer_format(self.hf))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # add_special_tokens lets the tokenizer's own post-processor decide about BOS.
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_texts(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (special tokens included), for log-probabilities."""
        return self.hf.batch_decode([[i] for i in ids])

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict] | None = None, *,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False, **kwargs: Any) -> list[int]:
        """``tools``: OpenAI tool definitions (rendered as :mod:`.chat_tools` says);
        ``kwargs`` become variables of the template (a request's ``chat_template_kwargs``)."""
        if not self.hf.chat_template:
            raise ValueError(f"model {self.name!r} has no chat template; "
                             "send a plain prompt instead")
        messages, tools = tool_template_inputs(self.hf, messages, tools, self.tool_format)
        try:
            ids = self.hf.apply_chat_template(
                messages, tools=tools, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tokenize=True,
                return_dict=False, **kwargs)
        except (TemplateError, IndexError, TypeError) as exc:  # e.g. its raise_exception()
            raise ValueError(f"messages: the chat template cannot render them: {exc}") from exc
        return list(ids)


def _declared_eos(path: str) -> set[int]:
    """eos ids from generation_config.json / config.json (an int or a list)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file) as f:
                eos = json.load(f).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids
