"""The embedded English corpus: perplexity windows and filler text for retrieval prompts."""

from __future__ import annotations

import functools
import re
from pathlib import Path

from slimkv.model_io.tokenizer import Tokenizer

CORPUS_PATH = Path(__file__).resolve().parent.parent / "data" / "eval_corpus.txt"
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


@functools.lru_cache(maxsize=1)
def corpus_text() -> str:
    """Original essays written for the project (see ``slimkv/data/README.md``)."""
    return CORPUS_PATH.read_text(encoding="utf-8")


def sentences() -> list[str]:
    """Every sentence of the corpus, in order (titles count as sentences)."""
    out: list[str] = []
    for paragraph in corpus_text().split("\n\n"):
        out += [s for s in _SENTENCE_END.split(paragraph.strip()) if s]
    return out


def windows(tokenizer: Tokenizer, size: int, count: int | None = None) -> list[list[int]]:
    """Consecutive non-overlapping ``size``-token windows of the tokenized corpus (the
    ragged tail is dropped); the first ``count`` of them when ``count`` is given."""
    ids = tokenizer.hf.encode(corpus_text(), add_special_tokens=False)
    out = [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]
    return out[:count] if count is not None else out


class Filler:
    """Corpus sentences tokenized one by one, so that text can be cut at a sentence
    boundary near any token count and a fact planted between two sentences."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.pieces = [tokenizer.hf.encode(" " + s, add_special_tokens=False) for s in sentences()]

    def take(self, num_tokens: int, start: int = 0) -> list[list[int]]:
        """Sentences from sentence ``start`` on (wrapping around) totalling at most
        ``num_tokens`` tokens."""
        out: list[list[int]] = []
        total, i = 0, start
        while total + len(self.pieces[i % len(self.pieces)]) <= num_tokens:
            piece = self.pieces[i % len(self.pieces)]
            out.append(piece)
            total += len(piece)
            i += 1
        return out


def strided_windows(tokenizer: Tokenizer, context: int, count: int
                    ) -> list[tuple[list[int], int]]:
    """Sliding-window evaluation (as Hugging Face's strided perplexity): the corpus's
    predictable tokens (all but the first) cut into ``count`` disjoint, consecutive
    segments of nearly equal length that together cover them; per segment, the window of at
    most ``context`` tokens that ends with it, and how many of its last tokens are scored.
    Every scored token thus sees up to ``context - scored`` tokens of context before it."""
    ids = tokenizer.hf.encode(corpus_text(), add_special_tokens=False)
    targets = len(ids) - 1
    if not 0 < count <= targets:
        raise ValueError(f"cannot cut {targets} predictable tokens into {count} windows")
    bounds = [1 + round(i * targets / count) for i in range(count + 1)]
    out = []
    for start, end in zip(bounds, bounds[1:]):
        if end - start >= context:
            raise ValueError(f"{end - start}-token segments leave no context in a "
                             f"{context}-token window: use more windows")
        out.append((ids[max(0, end - context):end], end - start))
    return out
