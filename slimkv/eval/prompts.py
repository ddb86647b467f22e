"""What every generated task shares: a probe (prompt ids + expected answer + where the
fact was planted), chat framing around a slot, and exact-match scoring."""

from __future__ import annotations

import re
from dataclasses import dataclass

from slimkv.model_io.tokenizer import Tokenizer

SLOT = "<<slot>>"
# Generated tokens per probe: enough for a 5-digit key or a two-word name and punctuation.
MAX_NEW_TOKENS = 8


@dataclass(frozen=True, slots=True)
class Probe:
    """One question. ``needle`` is the ``[start, end)`` token span of the planted fact in
    ``prompt_ids`` and ``document`` the span of the text it was planted in (fact and
    filler); ``context`` is the budget (prompt + answer tokens) the prompt was made for."""

    task: str
    context: int
    label: str
    prompt_ids: list[int]
    answer: str
    needle: tuple[int, int]
    document: tuple[int, int]

    @property
    def depth(self) -> float:
        """Where the fact sits in its document: 0 at the start, 1 right at the end."""
        room = self.document[1] - self.document[0] - (self.needle[1] - self.needle[0])
        return (self.needle[0] - self.document[0]) / max(room, 1)


def encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.hf.encode(text, add_special_tokens=False)


def frame(tokenizer: Tokenizer, messages: list[dict[str, str]], primer: str) -> list[list[int]]:
    """Token ids of the chat-templated ``messages`` cut at each ``SLOT`` (the caller fills
    the slots with token ids); the assistant turn is opened and primed with ``primer`` so
    that the answer is the first thing generated."""
    text = tokenizer.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return [encode(tokenizer, part) for part in (text + primer).split(SLOT)]


def is_match(answer: str, generated: str) -> bool:
    """Exact match: the generation starts with the answer (case-insensitive), and the
    answer is not merely the prefix of a longer word or number."""
    text = generated.strip().strip("\"'*").lower()
    want = answer.lower()
    return text.startswith(want) and not re.match(r"\w", text[len(want):len(want) + 1])


def flat(pieces: list[list[int]]) -> list[int]:
    return [t for piece in pieces for t in piece]
