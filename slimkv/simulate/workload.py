"""The case's workload at token level: multi-turn sessions over a long document.

Like ``slimkv loadtest``'s ``long-sessions`` (slimkv/loadtest/workloads.py): a client
opens a session with a unique header and a document slice of ``doc_tokens`` tokens, asks
a question, gets ``max_tokens`` tokens back, and asks the next question with the whole
history in front of it (so a paged engine serves the history from its prefix cache); when
the next turn would not fit in ``context`` tokens it opens a new session. A client pauses
``think_time`` seconds on average (0.5-1.5x, seeded) after each answer; 0 is a closed loop.
Token ids are seeded random numbers: the scheduler never reads them, the prefix cache only
compares them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

QUESTION_TOKENS = 16   # a question and its chat-template wrapping
HEADER_TOKENS = 8      # the session's unique first line: sessions never share a prefix
VOCAB_LOW, VOCAB_HIGH = 300, 40000
_VOCAB = range(VOCAB_LOW, VOCAB_HIGH)


@dataclass(frozen=True, slots=True)
class SessionSpec:
    context: int = 4096
    doc_tokens: int = 2048
    max_tokens: int = 256
    think_time: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if HEADER_TOKENS + self.doc_tokens + QUESTION_TOKENS + self.max_tokens > self.context:
            raise ValueError("doc_tokens + max_tokens (+ header and question) must fit in context")


@dataclass(slots=True)
class Turn:
    request_id: str
    session: str
    prompt: list[int]
    max_tokens: int
    sent: float


@dataclass(slots=True)
class Client:
    """One user: the next turn of its current session, and when it is ready to send it."""

    index: int
    spec: SessionSpec
    rng: random.Random
    ready_at: float = 0.0
    history: list[int] = field(default_factory=list)
    session: str = ""
    num_sessions: int = 0
    num_turns: int = 0

    @classmethod
    def make(cls, index: int, spec: SessionSpec, start: float = 0.0) -> Client:
        rng = random.Random(f"{spec.seed}:{index}")
        # Clients start staggered over one think time, so a fleet does not arrive at once.
        return cls(index, spec, rng, start + rng.random() * spec.think_time)

    def next_turn(self, now: float) -> Turn:
        question = self._tokens(QUESTION_TOKENS)
        need = len(self.history) + QUESTION_TOKENS + self.spec.max_tokens
        if not self.history or need > self.spec.context:
            self.num_sessions += 1
            self.session = f"c{self.index}-s{self.num_sessions}"
            self.history = self._tokens(HEADER_TOKENS) + self._tokens(self.spec.doc_tokens)
        self.num_turns += 1
        prompt = self.history + question
        self.history = prompt
        return Turn(f"{self.session}-t{self.num_turns}", self.session, prompt,
                    self.spec.max_tokens, now)

    def answered(self, output_ids: list[int], now: float) -> None:
        self.history = self.history + list(output_ids)
        think = self.spec.think_time
        self.ready_at = now + (think * (0.5 + self.rng.random()) if think else 0.0)

    def _tokens(self, n: int) -> list[int]:
        return self.rng.choices(_VOCAB, k=n)   # ~5x faster than a randrange per token
