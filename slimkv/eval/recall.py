"""Head-of-document recall, the case's failure mode: named facts in a document's first
section (or a conversation's first turn), filler after them, a question at the end."""

from __future__ import annotations

import random
from dataclasses import dataclass

from slimkv.eval.corpus import Filler
from slimkv.eval.prompts import MAX_NEW_TOKENS, SLOT, Probe, encode, flat, frame
from slimkv.model_io.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class FactKind:
    name: str
    statement: str      # "{}" is the value
    question: str
    values: tuple[str, ...]

    @property
    def primer(self) -> str:
        """The statement up to the value, lower-cased to follow a lead such as "According
        to section 1, ": the answer is the next thing to say."""
        head = self.statement.split("{}")[0].rstrip()
        return head[0].lower() + head[1:]


FACT_KINDS = (
    FactKind("leader", "The leader of the expedition was {}.",
             "Who was the leader of the expedition?",
             ("Ada Morrow", "Tomas Reed", "Helen Vasquez", "Oskar Lind", "Mira Patel",
              "Jonah Brooks")),
    FactKind("ship", "The ship was called the {}.", "What was the ship called?",
             ("Silver Finch", "Grey Heron", "Northern Star", "Red Kestrel", "Quiet Harbor",
              "Blue Otter")),
    FactKind("port", "The expedition sailed from the port of {}.",
             "From which port did the expedition sail?",
             ("Carrow", "Bellmouth", "Dunmere", "Ashford", "Kelby", "Marston")),
    FactKind("cargo", "The main cargo of the ship was {}.", "What was the main cargo of the ship?",
             ("salted fish", "copper wire", "wool blankets", "green tea", "rope",
              "glass bottles")),
    FactKind("island", "The expedition was bound for the island of {}.",
             "For which island was the expedition bound?",
             ("Tarrow", "Ormsey", "Skerra", "Brannock", "Vellholm", "Lunday")),
)
_DOC = ("Read the document below carefully. Its first section holds facts you will be asked "
        "about.\n\nSection 1. The expedition (remember these facts)\n" + SLOT
        + "\n\nSection 2. Other notes\n" + SLOT + "\n\nQuestion about the facts in section 1: {}")
_DOC_LEAD = "According to section 1, "
_FIRST_TURN = "Here are some facts about an expedition. Please remember them.\n\n" + SLOT
_LAST_TURN = "About the facts in my first message: {}"
_TURN_LEAD = "According to your first message, "


def _facts(tokenizer: Tokenizer, seed: int) -> tuple[list[tuple[FactKind, str]], list[int]]:
    """A random value for every fact kind, and the ids of the statements of all of them,
    said twice: SmolLM2-135M recalls a fact stated once only from short documents (float32
    KV, 4K document: 2 of 5 facts stated once, 4 of 5 stated twice with the lead primers;
    docs/accuracy.md)."""
    rng = random.Random(seed)
    facts = [(kind, rng.choice(kind.values)) for kind in FACT_KINDS]
    text = " ".join(kind.statement.format(value) for kind, value in facts)
    return facts, encode(tokenizer, f"{text} To repeat: {text}")


def _assemble(task: str, context: int, label: str, answer: str, pieces: list[list[int]],
              needle: list[int], fillers: list[list[int]]) -> Probe:
    """``pieces[0] + needle + pieces[1] + fillers[0] + pieces[2] + ...``."""
    ids = pieces[0] + needle
    for piece, filler in zip(pieces[1:], fillers):
        ids += piece + filler
    start = len(pieces[0])
    return Probe(task, context, label, ids + pieces[-1], answer, (start, start + len(needle)),
                 (start, len(ids)))


def _budget(context: int, needle: list[int], frames: list[list[list[int]]]) -> int:
    """Filler tokens that fit ``context`` with the longest question: every probe of one
    document then shares the same text, read once and reused from the prefix cache."""
    return context - MAX_NEW_TOKENS - len(needle) - max(sum(map(len, f)) for f in frames)


def document_probes(tokenizer: Tokenizer, filler: Filler, context: int,
                    seed: int = 0) -> list[Probe]:
    """One document of about ``context`` tokens; one probe per fact of its first section."""
    facts, needle = _facts(tokenizer, seed)
    frames = [frame(tokenizer, [{"role": "user", "content": _DOC.format(kind.question)}],
                    _DOC_LEAD + kind.primer) for kind, _ in facts]
    text = flat(filler.take(_budget(context, needle, frames), start=53 * seed))
    return [_assemble("head_recall", context, kind.name, value, pieces, needle, [text])
            for (kind, value), pieces in zip(facts, frames)]


def conversation_probes(tokenizer: Tokenizer, filler: Filler, context: int, turns: int,
                        seed: int = 0) -> list[Probe]:
    """Facts in turn 1, passages to read in turns 2..N-1, the question in turn N."""
    facts, needle = _facts(tokenizer, seed)
    messages = [{"role": "user", "content": _FIRST_TURN},
                {"role": "assistant", "content": "I will remember these facts."}]
    for _ in range(turns - 2):
        messages += [{"role": "user", "content": "Please read this passage.\n\n" + SLOT},
                     {"role": "assistant", "content": "I have read the passage."}]
    frames = [frame(tokenizer, [*messages, {"role": "user",
                                            "content": _LAST_TURN.format(kind.question)}],
                    _TURN_LEAD + kind.primer) for kind, _ in facts]
    budget = _budget(context, needle, frames)
    passages = [flat(filler.take(budget // (turns - 2), start=53 * seed + 31 * t))
                for t in range(turns - 2)]
    return [_assemble("multi_turn", context, kind.name, value, pieces, needle, passages)
            for (kind, value), pieces in zip(facts, frames)]
