"""Helpers of the tools that drive an engine (bench, verify, profile, load test, dashboard):
seeded random prompts, stepping until every request is done, and percentiles."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from slimkv.engine.llm_engine import LLMEngine


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """Seeded random token ids, away from the special tokens at the start of the vocab."""
    import torch  # here: the load tester and the dashboard import this module for percentile

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(256, vocab, (length,), generator=gen).tolist()


def run_until_done(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)
