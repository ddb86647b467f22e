"""The decode window of ``slimkv bench engine``: steps in which all B sequences decode.

A batch's prefill spans many steps when ``batch x context`` exceeds the step budget, and the
sequences prefilled first decode during the later ones' prefill: timing from "everyone has
a first token" to "everyone is done" and dividing ``batch x new_tokens`` by it counts tokens
made before the clock started, and times a tail in which fewer than B sequences decode.
:func:`decode_window` starts after the last prefill step and times only steps in which
every one of the B sequences computed exactly one token and sampled one (a pure decode step
of the whole batch), ending at the first step that is not one (a sequence finished or was
preempted) or after ``max_steps``; it counts the tokens actually sampled in it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecodeWindow:
    steps: int       # full-batch decode steps timed
    tokens: int      # tokens sampled in them (batch x steps)
    seconds: float   # their wall time

    @property
    def tok_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 else None


def prefill_all(engine: Any, seqs: list) -> int:
    """Step until every sequence of ``seqs`` has its first token; returns the steps taken."""
    steps = 0
    while any(s.num_output_tokens == 0 for s in seqs):
        if not engine.has_unfinished():
            raise RuntimeError("the engine finished before every sequence was prefilled")
        engine.step()
        steps += 1
    return steps


def decode_window(engine: Any, seqs: list, max_steps: int,
                  sync: Callable[[], None] = lambda: None,
                  clock: Callable[[], float] = time.perf_counter) -> DecodeWindow:
    """Up to ``max_steps`` steps from now (call after :func:`prefill_all`), timed while each
    is a decode step of all of ``seqs`` and of nothing else (``engine.requests``: the live
    sequences); ``sync`` waits for the device
    (the step's sampled tokens already come back to the host, so it is belt and braces)."""
    steps = tokens = 0
    seconds = 0.0
    sync()
    # Only these sequences live (none finished, no other request): else no full-batch step.
    while steps < max_steps and all(not s.is_finished for s in seqs) and \
            len(engine.requests) == len(seqs):
        outputs = [s.num_output_tokens for s in seqs]
        computed = [s.num_computed_tokens for s in seqs]
        start = clock()
        engine.step()
        sync()
        elapsed = clock() - start
        gained = [s.num_output_tokens - n for s, n in zip(seqs, outputs)]
        work = [s.num_computed_tokens - n for s, n in zip(seqs, computed)]
        if any(g != 1 for g in gained) or any(w != 1 for w in work):
            break  # a sequence finished, was preempted or shared the step: the window ends
        steps, tokens, seconds = steps + 1, tokens + sum(gained), seconds + elapsed
    return DecodeWindow(steps, tokens, seconds)


def prefill_steps_bound(batch: int, context: int, budget: int) -> int:
    """At most how many steps a batch's prefill takes (the budget less the decodes of those
    already prefilled, plus one step per sequence for the chunk that straddles two): the
    tokens the first-prefilled sequence can decode before the window opens, so
    ``max_tokens`` must leave room for them."""
    return -(-batch * context // max(1, budget - batch)) + batch
