"""Statistics for telling small accuracy differences apart: a paired bootstrap over corpus
windows (perplexity change, KL, top-1 agreement with 95% intervals) and the exact McNemar
test on paired right/wrong answers."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slimkv.eval.perplexity import TokenStats

RESAMPLES = 2000
SEED = 0


@dataclass(frozen=True, slots=True)
class Interval:
    """A point estimate (on every window) and its percentile bootstrap interval."""

    value: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float]:
        return {"value": self.value, "low": self.low, "high": self.high}


def _sums(windows: Sequence[TokenStats]) -> dict[str, np.ndarray]:
    return {"tokens": np.array([w.tokens for w in windows], dtype=np.float64),
            "nll": np.array([w.nll for w in windows], dtype=np.float64),
            "kl": np.array([w.kl for w in windows], dtype=np.float64),
            "agree": np.array([w.agree for w in windows], dtype=np.float64)}


def _metrics(ref: dict[str, np.ndarray], run: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Perplexity change in percent of the reference's, mean KL (nats/token) and top-1
    agreement (percent) from per-window sums (the last axis is summed)."""
    tokens = ref["tokens"].sum(-1)
    return {"ppl_change_pct": 100 * np.expm1((run["nll"].sum(-1) - ref["nll"].sum(-1)) / tokens),
            "kl": run["kl"].sum(-1) / tokens,
            "top1_agreement": 100 * run["agree"].sum(-1) / tokens}


def resample_indices(num_windows: int, resamples: int = RESAMPLES, seed: int = SEED
                     ) -> np.ndarray:
    """``[resamples, num_windows]`` window indices drawn with replacement; the same draw
    serves every format of a run, so that their intervals (and differences) are paired."""
    return np.random.default_rng(seed).integers(0, num_windows, size=(resamples, num_windows))


def paired_bootstrap(reference: Sequence[TokenStats], run: Sequence[TokenStats],
                     floor: Sequence[TokenStats] | None = None,
                     indices: np.ndarray | None = None, level: float = 0.95
                     ) -> dict[str, Interval]:
    """Each metric of ``run`` against ``reference`` window by window (the two lists are the
    same windows, in order); with ``floor``, the metric minus the floor run's on the same
    resampled windows (what the run costs above the floor)."""
    if len(reference) != len(run) or not run:
        raise ValueError("paired bootstrap needs the same, non-empty list of windows")
    idx = resample_indices(len(run)) if indices is None else indices
    ref, mine = _sums(reference), _sums(run)
    point, boot = _metrics(ref, mine), _metrics(_take(ref, idx), _take(mine, idx))
    if floor is not None:
        low = _sums(floor)
        base, base_boot = _metrics(ref, low), _metrics(_take(ref, idx), _take(low, idx))
        point = {k: v - base[k] for k, v in point.items()}
        boot = {k: v - base_boot[k] for k, v in boot.items()}
    tail = 100 * (1 - level) / 2
    return {k: Interval(float(point[k]), float(np.percentile(boot[k], tail)),
                        float(np.percentile(boot[k], 100 - tail))) for k in point}


def _take(sums: dict[str, np.ndarray], idx: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[idx] for k, v in sums.items()}


@dataclass(frozen=True, slots=True)
class McNemar:
    """Paired right/wrong answers: ``b`` probes the reference gets right and the run
    wrong, ``c`` the reverse, and the exact two-sided p-value of b against c."""

    b: int
    c: int

    @property
    def p_value(self) -> float:
        return mcnemar_p(self.b, self.c)

    def to_dict(self) -> dict[str, float]:
        return {"b": self.b, "c": self.c, "p": self.p_value}


def mcnemar(reference: Sequence[bool], run: Sequence[bool]) -> McNemar:
    if len(reference) != len(run):
        raise ValueError("McNemar needs the same probes for both runs")
    return McNemar(sum(r and not m for r, m in zip(reference, run)),
                   sum(m and not r for r, m in zip(reference, run)))


def mcnemar_p(b: int, c: int) -> float:
    """Exact two-sided McNemar p-value: twice the binomial(b + c, 1/2) tail at min(b, c),
    capped at 1 (1.0 when there is no discordant pair)."""
    n = b + c
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n
    return min(1.0, 2 * tail)
