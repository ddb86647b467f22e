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
