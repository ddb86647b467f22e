"""What the offload tier reports, per tier, in :attr:`EngineStats.offload`."""

from __future__ import annotations

from dataclasses import dataclass

# Upper bounds (seconds) of the load-latency histogram's buckets (+Inf implied).
LOAD_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier (``host`` or ``disk``): counters in blocks since start (stored and dropped
    count 16 per chunk, a partial one too; loaded counts the blocks loaded), its size now,
    and its chunk loads per ``LOAD_BUCKETS`` bucket (the last entry counts loads slower
    than every bound)."""

    stored_blocks: int = 0
    loaded_blocks: int = 0
    dropped_blocks: int = 0     # never stored (writer queue full, disk full) or pushed out
    corrupt_blocks: int = 0     # in files found corrupt, skipped and removed
    num_bytes: int = 0
    capacity_bytes: int = 0
    load_counts: tuple[int, ...] = (0,) * (len(LOAD_BUCKETS) + 1)
    load_seconds: float = 0.0
