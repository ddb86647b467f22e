"""Which sequences run this step, and how many tokens each: continuous batching with
page-level allocation and the case's admission policies.

Every step: running sequences first (in admission order) get their next tokens (a decode,
or the next chunk of a prefill) under the ``max_num_batched_tokens`` budget; a sequence
that cannot get a block preempts the most recently admitted one (recompute). Then waiting
sequences are admitted while the budget lasts, below the soft concurrency limit and the
KV watermark. Under the ``weighted`` policy a request's weight is the cache it will hold
(prompt + max_tokens, in blocks); heavy ones go to a slow lane whose share of blocks and
of each step's token budget is capped, so short requests never queue behind a long prefill.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from slimkv.config import KVCacheConfig, SchedulerConfig
from slimkv.kv.manager import KVCacheManager
from slimkv.engine.sequence import Sequence, SequenceStatus
from slimkv.stats import cdiv

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv_config: KVCacheConfig, config: SchedulerConfig,
                 manager: KVCacheManager) -> None:
        self.kv_config = kv_config
        self.config = config
        self.manager = manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.watermark_alert = False
        self.num_preemptions = 0

    # -- queue -------------------------------------------------------------------------

    def lane_of(self, seq: Sequence) -> str:
        if self.config.policy == "fcfs":
            return "fast"
        blocks = cdiv(seq.max_total_tokens(), self.manager.block_size)
        return "slow" if blocks > self.config.long_request_blocks else "fast"

    def add(self, seq: Sequence) -> None:
        seq.lane = self.lane_of(seq)
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it (abort or finish)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def num_running(self, lane: str | None = None) -> int:
        return sum(1 for s in self.running if lane is None or s.lane == lane)

    def num_waiting(self, lane: str | None = None) -> int:
        return sum(1 for s in self.waiting if lane is None or s.lane == lane)

    # -- one step ----------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        slow_budget = self._slow_token_budget(budget)
        budget, slow_budget = self._schedule_running(out, budget, slow_budget)
        self._update_watermark()
        if not out.preempted:
            self._admit_waiting(out, budget, slow_budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int,
                          slow_budget: int) -> tuple[int, int]:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget,
                    slow_budget if seq.lane == "slow" else budget)
            if n == 0:
                i += 1
                continue
            while not self.manager.can_allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break
            self.manager.allocate(seq, n)
            out.scheduled.append((seq, n))
            budget -= n
            if seq.lane == "slow":
                slow_budget -= n
            i += 1
        return budget, slow_budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, slow_budget: int) -> None:
        while budget > 0 and self.waiting and self.can_admit():
            seq = self._next_waiting(slow_budget)
            if seq is None:
                return
            computed = self.manager.get_computed_blocks(seq)   # waiting: nothing computed
            remaining = seq.num_tokens - len(computed) * self.manager.block_size
            n = min(remaining, budget, slow_budget if seq.lane == "slow" else budget)
            if not self.manager.can_allocate(seq, n, computed):
                return
            self.waiting.remove(seq)
            self.manager.allocate(seq, n, computed)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append((seq, n))
            budget -= n
            if seq.lane == "slow":
                slow_budget -= n

    def can_admit(self) -> bool:
        """Below the soft concurrency limit and the KV watermark."""
        return (len(self.running) < self.kv_config.max_concurrency_soft
                and not self.watermark_alert)

    def _next_waiting(self, slow_budget: int) -> Sequence | None:
        if self.config.policy == "fcfs":
            return self.waiting[0]
        for seq in self.waiting:
            if seq.lane == "fast":
                return seq
        seq = self.waiting[0]
        return seq if slow_budget > 0 and self._slow_lane_has_room(seq) else None

    def _slow_lane_has_room(self, seq: Sequence) -> bool:
        """A slow-lane request is admitted while the lane's blocks (with its own weight)
        stay under the lane's share of the pool; one is always allowed to run alone."""
        slow_running = [s for s in self.running if s.lane == "slow"]
        if not slow_running:
            return True
        bs = self.manager.block_size
        weight = sum(cdiv(s.max_total_tokens(), bs) for s in slow_running + [seq])
        return weight <= self.config.slow_lane_block_share * self.manager.pool.num_blocks

    def _slow_token_budget(self, budget: int) -> int:
        """The slow lane's share of this step's tokens, when fast-lane work is pending."""
        if self.config.policy == "fcfs":
            return budget
        fast_pending = any(s.lane == "fast" for s in self.waiting) or any(
            s.lane == "fast" and s.num_uncomputed_tokens > 1 for s in self.running)
        if not fast_pending:
            return budget
        return max(self.manager.block_size, int(budget * self.config.slow_lane_token_share))

    def _update_watermark(self) -> None:
        usage = self.manager.pool.usage
        mark = self.kv_config.watermark
        if not self.watermark_alert and usage >= mark:
            self.watermark_alert = True
            log.warning("KV cache usage %.1f%% reached the %.0f%% watermark: "
                        "new requests queue until it falls", usage * 100, mark * 100)
        elif self.watermark_alert and usage < mark - self.kv_config.watermark_hysteresis:
            self.watermark_alert = False
            log.info("KV cache usage %.1f%% back under the watermark: admitting again",
                     usage * 100)

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: free the blocks and requeue at the front."""
        self.manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
