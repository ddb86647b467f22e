"""Thin wrapper over a Hugging Face tokenizer with the few calls the engine needs."""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Iterable, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

import tokenizers
import transformers
from jinja2 import TemplateError
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from slimkv.model_io.chat_tools import serving_format, tool_template_inputs
from slimkv.model_io.model_cache import cache_path, publish
from slimkv.options.tool_formats import ToolCallFormat, tokenizer_format

# End-of-turn / end-of-document markers that stop generation when a model's vocab has them.
_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "<|eom_id|>")
_QUANT_SUFFIX = re.compile(r"[.-](?:i?q\d\w*|f\d+|bf16)$", re.IGNORECASE)  # ".Q4_1", "-f16"
_log = logging.getLogger(__name__)


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
        """The GGUF's vocab as transformers converts it (with ``tokenizer.chat_template``).
        Converting takes ~4.5 s (two cores), mostly parsing the vocab's ~100K strings, and
        every engine process paid it; so the conversion is kept as a tokenizer folder
        (:func:`cache_folder`, loaded in ~0.2 s), once the folder's tokenizer has answered
        the probes of :func:`same_answers` as the converted one does."""
        stem = os.path.splitext(os.path.basename(path))[0]
        name = _QUANT_SUFFIX.sub("", stem)
        folder = cache_folder(path)
        if (folder / "tokenizer_config.json").is_file():
            return cls(AutoTokenizer.from_pretrained(folder), name)
        tokenizer = cls(AutoTokenizer.from_pretrained(os.path.dirname(path) or ".",
                                                      gguf_file=os.path.basename(path)), name)
        _store(tokenizer, folder)
        return tokenizer

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


def cache_folder(gguf_path: str) -> Path:
    """Where :meth:`Tokenizer.from_gguf` keeps the conversion of ``gguf_path``."""
    return cache_path(gguf_path, "tokenizer", transformers.__version__, tokenizers.__version__)


def same_answers(a: Tokenizer, b: Tokenizer) -> bool:
    """Whether ``b`` answers as ``a``: sizes, special and stop tokens, chat template, and
    encode / decode of a text holding every added token, with and without specials."""
    added = a.hf.get_added_vocab()
    text = (" ".join(added) + " The café's naïve 数据 ☃ 😀\n\tdef f(x):\n    return x  ")
    ids = a.encode(text)
    strided = range(0, a.vocab_size, 97)
    return (a.vocab_size == b.vocab_size and added == b.hf.get_added_vocab()
            and a.eos_token_ids == b.eos_token_ids and a.hf.chat_template == b.hf.chat_template
            and (a.hf.bos_token_id, a.hf.pad_token_id) == (b.hf.bos_token_id, b.hf.pad_token_id)
            and ids == b.encode(text) and a.encode(text, False) == b.encode(text, False)
            and a.decode(ids) == b.decode(ids) and a.decode(ids, False) == b.decode(ids, False)
            and a.token_texts(strided) == b.token_texts(strided))


def _store(tokenizer: Tokenizer, folder: Path) -> None:
    """Save ``tokenizer`` as ``folder`` if it reloads with the same answers."""
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder.parent, ignore_cleanup_errors=True) as tmp:
            tokenizer.hf.save_pretrained(tmp)
            if same_answers(tokenizer, Tokenizer(AutoTokenizer.from_pretrained(tmp), "")):
                publish(tmp, folder)
            else:
                _log.info("the tokenizer of %s differs once saved: not cached", folder.name)
    except OSError as exc:     # e.g. a read-only home
        _log.info("tokenizer not cached in %s: %s", folder.parent, exc)
