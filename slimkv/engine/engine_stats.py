"""What the engine reports about itself: one frozen snapshot per call of
:meth:`LLMEngine.stats`, the only view of the engine that metrics, the dashboard and the
server loop read (plus :class:`BlockInfo`, the dashboard's per-block map).

Fields are static facts (formats, sizes), the state now (queues, pool), and monotonic
counters since start. :class:`CounterDeltas` is the one place counters become increments.
New fields go at the end with a default, so every reader keeps working.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LaneCounts:
    running: int
    waiting: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    # -- static facts
    model_name: str
    k_dtype: str
    v_dtype: str
    bytes_per_token: float          # KV pool bytes per token, all layers, K and V, scales
    block_size: int
    num_blocks: int
    memory: Mapping[str, int]       # weights, kv_cache, kv_staging, activations (bytes)
    watermark: float
    evict_policy: str
    max_concurrency_soft: int
    # -- the state now
    step: int
    num_running: int
    num_waiting: int
    lanes: Mapping[str, LaneCounts]
    num_free_blocks: int            # ref count 0: free, cached and pinned blocks
    watermark_alert: bool
    # -- monotonic counters since start
    prefix_queries: int             # prompt tokens looked up in the prefix cache
    prefix_hits: int                # of those, tokens found
    preemptions: int
    evictions: int                  # cached blocks whose content was dropped for reuse
    false_ooms: int                 # contiguous baseline: requests refused with room left
    attention_paths: Mapping[str, int] = field(default_factory=dict)  # layer calls per path
    finished: Mapping[str, int] = field(default_factory=dict)         # requests per reason
    offload: Mapping[str, object] = field(default_factory=dict)  # TierStats (kv/offload) by tier

    @property
    def num_blocks_used(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by live sequences (free cached blocks count as free)."""
        return self.num_blocks_used / self.num_blocks

    def counters(self) -> dict[str, int]:
        """Every monotonic counter by name; per-path and per-reason ones as ``path:<name>``
        and ``finished:<reason>``."""
        return {"prefix_queries": self.prefix_queries, "prefix_hits": self.prefix_hits,
                "preemptions": self.preemptions, "evictions": self.evictions,
                "false_ooms": self.false_ooms,
                **{f"path:{p}": n for p, n in self.attention_paths.items()},
                **{f"finished:{r}": n for r, n in self.finished.items()}}


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One block of the pool as the dashboard shows it. ``state``: ``in_use`` (held by a
    sequence), ``staging`` (held, its tokens still in a full-precision staging slot),
    ``pinned`` (free, head of a live session), ``cached`` (free, prefix-cached), ``free``."""

    block_id: int
    state: str
    ref_cnt: int
    holders: tuple[tuple[str, int], ...]   # (request id, index of the block in its table)
    session: str | None
    last_used: int                         # the pool's logical clock at its last use
