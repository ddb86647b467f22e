"""One PNG: corpus metrics per KV dtype on top, a passkey heat-map per dtype below."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from slimkv.eval.harness import DtypeRun, EvalRun  # noqa: E402
from slimkv.eval.report import metrics, regressions  # noqa: E402


def passkey_grid(run: DtypeRun, ev: EvalRun) -> tuple[list[int], list[str], np.ndarray]:
    """Accuracy per (context, depth) cell: rows are contexts, columns depths."""
    cells = [(p.context, p.label, hit)
             for p, hit in zip(ev.probes, run.hits) if p.task == "passkey"]
    contexts = sorted({c for c, _, _ in cells})
    depths = list(dict.fromkeys(label for _, label, _ in cells))
    grid = np.zeros((len(contexts), len(depths)))
    counts = np.zeros_like(grid)
    for context, label, hit in cells:
        i, j = contexts.index(context), depths.index(label)
        grid[i, j] += hit
        counts[i, j] += 1
    return contexts, depths, grid / np.maximum(counts, 1)


def _bars(ax: Axes, names: list[str], values: list[float], title: str) -> None:
    ax.bar(names, values, color="tab:blue")
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)


def _heatmap(ax: Axes, run: DtypeRun, ev: EvalRun, title: str) -> None:
    contexts, depths, grid = passkey_grid(run, ev)
    ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
    ax.set_xticks(range(len(depths)), depths, fontsize=7)
    ax.set_yticks(range(len(contexts)), [f"{c // 1024}K" if c >= 1024 else str(c)
                                         for c in contexts], fontsize=7)
    for (i, j), value in np.ndenumerate(grid):
        ax.text(j, i, f"{value:.0%}", ha="center", va="center", fontsize=6)
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("depth", fontsize=7)


def plot(ev: EvalRun, path: str | Path) -> None:
    runs = [ev.reference, *ev.runs]
    names = [r.dtype for r in ev.runs]
    fig = plt.figure(figsize=(max(9, 2.2 * len(runs)), 7), constrained_layout=True)
    top, bottom = fig.subfigures(2, 1, height_ratios=[1, 1])
    axes = top.subplots(1, 3)
    _bars(axes[0], names, [regressions(r, ev)["perplexity"] for r in ev.runs],
          f"perplexity regression vs {ev.reference.dtype} (%)")
    _bars(axes[1], names, [metrics(r, ev)["kl"] for r in ev.runs], "mean KL (nats/token)")
    _bars(axes[2], names, [100 - metrics(r, ev)["top1_agreement"] for r in ev.runs],
          "top-1 disagreement (%)")
    maps = np.atleast_1d(bottom.subplots(1, len(runs)))
    for ax, run in zip(maps, runs):
        label = f"{run.dtype} (ref)" if run is ev.reference else run.dtype
        _heatmap(ax, run, ev, f"passkey: {label}")
    fig.suptitle(f"slimkv eval ({ev.suite.name}): {ev.model}, {ev.corpus_tokens} corpus tokens")
    fig.savefig(path, dpi=110)
    plt.close(fig)
