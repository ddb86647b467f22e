"""Seeded synthetic work for the tools that drive an engine directly (bench, verify,
profile): random prompts, and stepping until every request is done."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from slimkv.engine import LLMEngine


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """Seeded random token ids, away from the special tokens at the start of the vocab."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(256, vocab, (length,), generator=gen).tolist()


def run_until_done(engine: LLMEngine) -> None:
    while engine.has_unfinished():
        engine.step()
