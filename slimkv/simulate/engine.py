"""A simulated engine: the real scheduler, KV manager and block pool on a simulated clock.

:class:`SimEngine` does what :meth:`slimkv.engine.llm_engine.LLMEngine.step` does, decision for
decision (the same ``Scheduler.schedule()``, ``KVCacheManager.allocate/free/
cache_full_blocks``, prefix hits, watermark, lanes, preemption, session-head protection),
but where the engine runs a model forward it asks a step-time model how long that batch
would take and advances its clock by that much; the sampled token is a deterministic
stand-in (generation is ``ignore_eos``: a turn ends at ``max_tokens``). No torch, no
weights. ``tests/test_simulate.py`` pins it to the real engine step by step.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from slimkv.config import KVCacheConfig, SchedulerConfig
from slimkv.kv.block_pool import BlockPool
from slimkv.kv.contiguous import ContiguousKVManager
from slimkv.kv.manager import KVCacheManager
from slimkv.engine.sampling_params import SamplingParams
from slimkv.engine.scheduler import Scheduler
from slimkv.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class Batch:
    """What a step runs, as a step-time model sees it: per sequence, the tokens it computes
    this step and the tokens already in its context before them."""

    new_tokens: tuple[int, ...]
    context: tuple[int, ...]
    num_sampled: int

    @property
    def num_tokens(self) -> int:
        return sum(self.new_tokens)


StepTime = Callable[[Batch], float]


@dataclass(slots=True)
class Finished:
    """A finished request as the workload driver sees it (times on the engine's clock)."""

    request_id: str
    token_ids: list[int]
    arrival: float
    first_token: float
    end: float
    num_output_tokens: int
    num_cached_tokens: int


@dataclass(slots=True)
class StepRecord:
    """One step's decisions (request ids) and its simulated duration."""

    step: int
    admitted: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    num_tokens: int = 0
    duration: float = 0.0
    batch: Batch | None = None

    @property
    def is_decode(self) -> bool:
        """Every sequence of the step computed one token (no prefill chunk)."""
        return self.batch is not None and self.num_tokens == len(self.batch.new_tokens)


class SimEngine:
    """The bookkeeping half of ``LLMEngine`` (see the module doc)."""

    def __init__(self, kv: KVCacheConfig, sched: SchedulerConfig, num_blocks: int,
                 max_model_len: int, step_time: StepTime, num_staging_slots: int = 0,
                 start: float = 0.0) -> None:
        self.kv = kv
        self.max_model_len = max_model_len
        self.step_time = step_time
        self.now = start
        self.pool = BlockPool(num_blocks, kv.enable_prefix_caching and kv.paged, kv.evict_policy)
        opts = dict(session_ttl_s=kv.session_ttl_s, num_staging_slots=num_staging_slots)
        self.manager = (KVCacheManager(self.pool, kv.block_size, **opts) if kv.paged else
                        ContiguousKVManager(self.pool, kv.block_size, max_model_len, **opts))
        getattr(self.manager, "paged", self.manager).clock = lambda: self.now
        self.scheduler = Scheduler(kv, sched, self.manager)
        self.requests: dict[str, Sequence] = {}
        self.num_steps = 0
        self._ids = itertools.count()
        self._no_expiry_before = -math.inf

    def add_request(self, prompt: list[int], params: SamplingParams,
                    request_id: str | None = None,
                    session_id: Hashable | None = None) -> Sequence:
        request_id = request_id or f"req-{next(self._ids)}"
        seq = Sequence(request_id, prompt, params, session_id=session_id)
        seq.arrival_time = self.now
        seq.arrival_step = self.num_steps
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def idle_until(self, t: float) -> None:
        """Nothing to run: the clock jumps to the next arrival."""
        self.now = max(self.now, t)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> tuple[StepRecord, list[Finished]]:
        """One engine step: schedule, charge the batch's time, append tokens, finish."""
        self.num_steps += 1
        record = StepRecord(self.num_steps)
        self._expire_sessions()
        num_before = len(self.scheduler.running)
        out = self.scheduler.schedule()
        # Admissions are appended to ``running``, and only in a step that preempted none.
        record.admitted = [] if out.preempted else [
            s.request_id for s in self.scheduler.running[num_before:]]
        record.preempted = [s.request_id for s in out.preempted]
        if not out.scheduled:
            return record, []
        new_tokens, context, sampled = [], [], []
        for seq, n in out.scheduled:
            if seq.scheduled_time is None:
                seq.scheduled_time = self.now
            new_tokens.append(n)
            context.append(seq.num_computed_tokens)
            if seq.num_computed_tokens + n == seq.num_tokens:
                sampled.append(seq)
        batch = Batch(tuple(new_tokens), tuple(context), len(sampled))
        record.num_tokens, record.batch = batch.num_tokens, batch
        record.duration = self.step_time(batch)
        self.now += record.duration
        for seq, n in out.scheduled:
            seq.num_computed_tokens += n
            self.manager.cache_full_blocks(seq)
        finished = [f for f in (self._append_token(seq) for seq in sampled) if f is not None]
        record.finished = [f.request_id for f in finished]
        return record, finished

    def _expire_sessions(self) -> None:
        """``manager.expire_sessions()``, skipped while no session can be past its TTL: the
        oldest ``last_seen`` + TTL bounds every session's expiry from below (``last_seen``
        only grows; a new session is seen now), so a skipped call would have expired none.
        The engine's per-step scan is over every session: at fleet scale it dominated."""
        manager = getattr(self.manager, "paged", self.manager)
        if self.now <= self._no_expiry_before:
            return
        manager.expire_sessions()
        oldest = min((s.last_seen for s in manager.sessions.values()), default=self.now)
        self._no_expiry_before = oldest + manager.session_ttl_s

    def _append_token(self, seq: Sequence) -> Finished | None:
        if seq.first_token_time is None:
            seq.first_token_time = self.now
            seq.first_token_step = self.num_steps
        seq.last_token_time = self.now
        seq.token_ids.append(stand_in_token(seq))
        if seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
            self.scheduler.remove(seq)
            self.manager.free(seq)
            seq.status = SequenceStatus.FINISHED
            del self.requests[seq.request_id]
            return Finished(seq.request_id, seq.output_token_ids, seq.arrival_time,
                            seq.first_token_time, self.now, seq.num_output_tokens,
                            seq.num_cached_tokens)
        return None


def stand_in_token(seq: Sequence) -> int:
    """A deterministic token id for a sampled position (any id in the vocabulary's body
    would do: the scheduler never reads token values, the prefix cache only compares them)."""
    return 1000 + (seq.num_tokens * 7919 + len(seq.request_id)) % 20000
