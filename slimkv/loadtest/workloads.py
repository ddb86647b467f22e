"""Seeded workloads: what each closed-loop client sends, turn after turn.

A workload hands every client its own ``Session`` source. ``long-sessions`` clients hold a
multi-turn conversation over a slice of a long document and keep the whole history, so each
turn re-sends everything before it (a paged server serves it from its prefix cache); when
the next turn would not fit in ``context`` tokens the client starts a new session on another
slice. ``chat`` clients send short one-turn questions. ``mixed`` alternates the two across
clients. Content depends only on ``(seed, concurrency, client)``, so a run is reproducible
and two concurrency levels never share a prompt prefix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from importlib import resources

WORKLOADS = ("long-sessions", "chat", "mixed")
CHARS_PER_TOKEN = 3  # a deliberately low estimate: a session never overruns its context
DOC_CHARS_PER_TOKEN = 4  # English prose, for sizing the document slice
QUESTIONS = (
    "Summarize the passage in two sentences.",
    "Which facts in the passage are the most surprising, and why?",
    "List three names or numbers the passage mentions.",
    "What happened first, according to the passage?",
    "Explain the main problem the passage describes.",
    "What would you ask the author next?",
)
CHAT_PROMPTS = (
    "Give me a fun fact about lighthouses.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I boil an egg?",
    "Name three primary colors.",
    "Why is the sky blue?",
    "Suggest a name for a small boat.",
    "What is two plus two?",
)

Message = dict[str, str]


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Sizes in tokens: ``context`` bounds a long session's history plus its generations;
    ``doc_tokens`` is the document slice a session opens with."""

    name: str = "long-sessions"
    context: int = 2048
    doc_tokens: int = 1024
    max_tokens: int = 64
    chat_max_tokens: int = 32
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose one of {', '.join(WORKLOADS)}")
        if self.doc_tokens + self.max_tokens >= self.context:
            raise ValueError(f"doc_tokens + max_tokens must be under context ({self.context})")


@dataclass(slots=True)
class Turn:
    """One request: the full message list and how many tokens to ask for."""

    messages: list[Message]
    max_tokens: int
    session: str
    turn: int = 1                     # 1 for a session's first request


def corpus() -> str:
    return resources.files("slimkv").joinpath("data/eval_corpus.txt").read_text()


@dataclass(slots=True)
class LongSession:
    """A multi-turn conversation over one document slice; ``used`` counts its tokens."""

    session: str
    spec: WorkloadSpec
    rng: random.Random
    history: list[Message] = field(default_factory=list)
    used: int = 0

    def next_turn(self) -> Turn | None:
        """The next request, or None when it would not fit in ``spec.context`` (the
        first turn is always sent: its size is fixed by ``doc_tokens``)."""
        question = self.rng.choice(QUESTIONS)
        need = self.used + len(question) // CHARS_PER_TOKEN + 8 + self.spec.max_tokens
        if len(self.history) > 1 and need > self.spec.context:
            return None
        self.history.append({"role": "user", "content": question})
        turn = sum(m["role"] == "user" for m in self.history)
        return Turn(list(self.history), self.spec.max_tokens, self.session, turn)

    def record(self, reply: str, total_tokens: int | None) -> None:
        """Keep the reply; ``total_tokens`` is the server's usage (prompt + completion)."""
        self.history.append({"role": "assistant", "content": reply})
        chars = sum(len(m["content"]) for m in self.history)
        self.used = total_tokens if total_tokens is not None else chars // CHARS_PER_TOKEN


class ClientWorkload:
    """The endless, seeded stream of turns of one closed-loop client."""

    def __init__(self, spec: WorkloadSpec, concurrency: int, client: int, text: str) -> None:
        self.spec = spec
        self.rng = random.Random(f"{spec.seed}:{concurrency}:{client}")
        self.prefix = f"c{concurrency}-{client}"
        self.long = spec.name == "long-sessions" or (spec.name == "mixed" and client % 2 == 0)
        self.text = text
        self.count = 0
        self.current: LongSession | None = None

    def next_turn(self) -> Turn:
        self.count += 1
        if not self.long:
            prompt = self.rng.choice(CHAT_PROMPTS)
            return Turn([{"role": "user", "content": prompt}], self.spec.chat_max_tokens,
                         f"{self.prefix}-chat{self.count}")
        turn = self.current.next_turn() if self.current else None
        if turn is None:
            self.current = self._new_session()
            turn = self.current.next_turn()
        return turn

    def record(self, reply: str, total_tokens: int | None) -> None:
        if self.current is not None:
            self.current.record(reply, total_tokens)

    def fail(self) -> None:
        """A turn failed: its history has a question without an answer, so start afresh."""
        self.current = None

    def _new_session(self) -> LongSession:
        """A session opening on a random document slice of about ``doc_tokens`` tokens;
        its unique first line keeps sessions from sharing a cached prefix."""
        name = f"{self.prefix}-s{self.count}"
        size = self.spec.doc_tokens * DOC_CHARS_PER_TOKEN
        start = self.rng.randrange(max(1, len(self.text) - size))
        doc = self.text[start:start + size]
        system = (f"Session {name}. You answer questions about this document.\n\n"
                  f"<document>\n{doc}\n</document>")
        session = LongSession(name, self.spec, self.rng, [{"role": "system", "content": system}])
        session.used = len(system) // CHARS_PER_TOKEN
        return session
