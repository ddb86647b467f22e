"""Passkey retrieval: a key planted at a given depth of a long text, asked at the end."""

from __future__ import annotations

import random

from slimkv.eval.corpus import Filler
from slimkv.eval.prompts import MAX_NEW_TOKENS, SLOT, Probe, encode, flat, frame
from slimkv.model_io.tokenizer import Tokenizer

_USER = ("A pass key is hidden in the text below. Find it and remember it.\n\n" + SLOT
         + "\n\nWhat is the pass key hidden in the text? Answer with the number.")
# Primed with "The pass key is", SmolLM2 explains what a pass key is (4K float32 KV: 1 key
# in 5); naming the text it was hidden in makes it copy the key from there instead.
_PRIMER = "The pass key hidden in the text is"


def _cut(pieces: list[list[int]], depth: float) -> int:
    """The sentence boundary whose token offset is nearest ``depth`` of the text."""
    total = sum(map(len, pieces))
    offsets = [0]
    for piece in pieces:
        offsets.append(offsets[-1] + len(piece))
    return min(range(len(offsets)), key=lambda k: abs(offsets[k] - depth * total))


def passkey_probe(tokenizer: Tokenizer, filler: Filler, context: int, depth: float,
                  key: str, start: int = 0) -> Probe:
    """A prompt of at most ``context - MAX_NEW_TOKENS`` tokens with the key at ``depth``."""
    head, tail = frame(tokenizer, [{"role": "user", "content": _USER}], _PRIMER)
    needle = encode(tokenizer, f" The pass key is {key}. Remember it. {key} is the pass key.")
    budget = context - MAX_NEW_TOKENS - len(head) - len(tail) - len(needle)
    if budget <= 0:
        raise ValueError(f"a {context}-token context leaves no room for filler")
    pieces = filler.take(budget, start)
    k = _cut(pieces, depth)
    before = head + flat(pieces[:k])
    ids = before + needle + flat(pieces[k:]) + tail
    return Probe("passkey", context, f"{depth:.0%}", ids, key,
                 (len(before), len(before) + len(needle)), (len(head), len(ids) - len(tail)))


def passkey_probes(tokenizer: Tokenizer, contexts: list[int], depths: list[float],
                   seed: int = 0) -> list[Probe]:
    """One probe per (context, depth) cell, each with its own random 5-digit key; all
    depths of one context share the same filler text."""
    rng = random.Random(seed)
    filler = Filler(tokenizer)
    return [passkey_probe(tokenizer, filler, context, depth, str(rng.randint(10000, 99999)),
                          start=97 * i)
            for i, context in enumerate(contexts) for depth in depths]


# Passkey placed by token position, for the stats suite: the document is the system message,
# so that it starts at token 3 (after "<|im_start|>system\n") and a short needle fits inside
# KV block 0. Token placements name where the needle's key digits sit relative to the
# 16-token blocks of the KV cache (kv_cache.block_size).
_SYSTEM_QUESTION = "What is the pass key hidden in the text? Answer with the number."
BLOCK = 16
TOKEN_PLACEMENTS = ("block0", "block1", "edge16", "edge_mid")


def _key_span(tokenizer: Tokenizer, needle: list[int], key: str) -> tuple[int, int]:
    """The ``[start, end)`` tokens of ``needle`` that spell ``key``."""
    for start in range(len(needle)):
        for end in range(start + 1, len(needle) + 1):
            if tokenizer.hf.decode(needle[start:end]) == key:
                return start, end
    raise ValueError(f"{key!r} is not spelled by the needle's tokens")


def _needle_offset(placement: str | float, head: int, doc: list[int], needle: int,
                   digits: tuple[int, int], pieces: list[list[int]]) -> int:
    """How many document tokens come before the needle so that it sits at ``placement``:
    a token placement (``TOKEN_PLACEMENTS``) or a depth fraction (nearest sentence end)."""
    if isinstance(placement, float):
        return len(flat(pieces[:_cut(pieces, placement)]))
    if placement == "block0":                     # the whole needle inside tokens 0-15
        start = head
    elif placement == "block1":                   # the whole needle inside tokens 16-31
        start = BLOCK + 2
    else:                                         # the key digits straddle a block edge
        edge = BLOCK if placement == "edge16" else BLOCK * round((head + len(doc) / 2) / BLOCK)
        start = edge - (digits[0] + digits[1]) // 2
    if placement not in TOKEN_PLACEMENTS or start < head:
        raise ValueError(f"cannot place a needle at {placement!r}")
    return start - head


def placed_passkey_probe(tokenizer: Tokenizer, filler: Filler, context: int,
                         placement: str | float, key: str, start: int = 0) -> Probe:
    """A prompt of at most ``context - MAX_NEW_TOKENS`` tokens whose document (the system
    message) holds " The pass key is KEY." at ``placement``."""
    head, tail = frame(tokenizer, [{"role": "system", "content": SLOT},
                                   {"role": "user", "content": _SYSTEM_QUESTION}], _PRIMER)
    needle = encode(tokenizer, f" The pass key is {key}.")
    digits = _key_span(tokenizer, needle, key)
    budget = context - MAX_NEW_TOKENS - len(head) - len(tail) - len(needle)
    pieces = filler.take(budget, start)
    doc = flat(pieces)
    k = _needle_offset(placement, len(head), doc, len(needle), digits, pieces)
    ids = head + doc[:k] + needle + doc[k:] + tail
    label = placement if isinstance(placement, str) else f"{placement:.0%}"
    return Probe("passkey", context, label, ids, key,
                 (len(head) + k, len(head) + k + len(needle)), (len(head), len(ids) - len(tail)))


def placed_passkey_probes(tokenizer: Tokenizer, contexts: list[int],
                          placements: list[str | float], keys: int, seed: int = 0
                          ) -> list[Probe]:
    """``keys`` probes per (context, placement) cell, each with its own 5-digit key (from
    ``seed``) and its own filler text; cells in order, keys within a cell consecutive."""
    rng = random.Random(seed)
    filler = Filler(tokenizer)
    return [placed_passkey_probe(tokenizer, filler, context, placement,
                                 str(rng.randint(10000, 99999)), start=97 * i + 31 * j)
            for i, context in enumerate(contexts) for placement in placements
            for j in range(keys)]
