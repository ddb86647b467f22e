"""Small arithmetic shared by the core (:func:`cdiv`) and statistics shared by the
benchmarks, the load tester and the dashboard."""

from __future__ import annotations

import math
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolated percentile (``q`` in 0..100); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def cdiv(a: int, b: int) -> int:
    """Ceiling division, e.g. the blocks of ``b`` tokens that hold ``a`` tokens."""
    return -(-a // b)
