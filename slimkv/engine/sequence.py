"""One request's tokens, progress and output state."""

from __future__ import annotations

import time
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, Hashable

from slimkv.kv.block_pool import Block
from slimkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    """A request as the engine sees it.

    ``token_ids`` holds prompt then output; ``num_computed_tokens`` of them have their KV in
    the cache. The scheduler only ever asks "how many tokens are not computed yet": a
    prefill, a chunk of one, a decode and a recompute after preemption are the same thing.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 session_id: Hashable | None = None, index: int = 0) -> None:
        self.request_id = request_id if index == 0 else f"{request_id}#{index}"  # unique
        self.parent_id = request_id  # the request it answers: one of its ``n`` choices
        self.index = index
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.lane = "fast"  # the scheduler's, set when it queues the sequence
        self.session_id = session_id
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at admission
        self.blocks: list[Block] = []
        self.staging_slot: int | None = None  # given by the KV manager when the cache is staged
        self.finish_reason: str | None = None
        self.output_text = ""
        self.num_emitted_chars = 0
        self.detok: tuple[int, int, str] = (0, 0, "")  # the Detokenizer's (see outputs.py)
        self.generator: torch.Generator | None = None  # a seeded request's, see ModelRunner
        self.matcher: Any = None  # the grammar state of a structured-output request
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.arrival_step = 0
        self.first_token_step: int | None = None
        self.num_preemptions = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def max_total_tokens(self) -> int:
        """Prompt plus the most it may generate: its cache weight for scheduling."""
        return self.num_prompt_tokens + self.params.max_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, {self.status.name}, "
                f"{self.num_computed_tokens}/{self.num_tokens} computed)")
