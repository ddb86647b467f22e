"""Turn an :class:`EvalRun` into metrics, regressions against the reference, the gate
verdict, and a table as text, markdown or JSON."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slimkv.eval.harness import TASKS, DtypeRun, EvalRun

# Metrics the gate checks. Perplexity regresses in percent of the reference's; a task
# regresses in accuracy points lost. KL and top-1 agreement are reported, not gated: they
# measure drift of the distribution (int8 disagrees on ~2% of tokens) rather than harm.
GATE_METRICS = ("perplexity", *TASKS)


def metrics(run: DtypeRun, ev: EvalRun) -> dict[str, float | None]:
    """Perplexity, KL (nats/token), top-1 agreement and task accuracies (percent)."""
    out: dict[str, float | None] = {
        "perplexity": run.stats.perplexity, "kl": run.stats.mean_kl,
        "top1_agreement": 100 * run.stats.top1_agreement}
    for task in TASKS:
        acc = run.accuracy(ev.probes, task)
        out[task] = None if acc is None else 100 * acc
    return out


def regressions(run: DtypeRun, ev: EvalRun) -> dict[str, float]:
    """Per gate metric, how much worse than the reference (positive = worse)."""
    mine, ref = metrics(run, ev), metrics(ev.reference, ev)
    out = {"perplexity": 100 * (mine["perplexity"] / ref["perplexity"] - 1)}
    for task in TASKS:
        if ref[task] is not None:
            out[task] = ref[task] - mine[task]
    return out


@dataclass(frozen=True, slots=True)
class GateFailure:
    dtype: str
    metric: str
    regression: float

    def __str__(self) -> str:
        unit = "%" if self.metric == "perplexity" else " points"
        return f"{self.dtype}: {self.metric} regressed {self.regression:.2f}{unit}"


def gate(ev: EvalRun, serving: list[str], max_regression: float) -> list[GateFailure]:
    """Every gate metric of every serving dtype that regressed past ``max_regression``."""
    return [GateFailure(run.dtype, metric, value)
            for run in ev.runs if run.dtype in serving
            for metric, value in regressions(run, ev).items() if value > max_regression]


def to_json(ev: EvalRun, serving: list[str], max_regression: float) -> dict[str, Any]:
    failures = gate(ev, serving, max_regression)
    return {
        "suite": ev.suite.name, "model": ev.model, "reference": ev.reference.dtype,
        "corpus_tokens": ev.corpus_tokens, "window": ev.suite.window,
        "reference_metrics": metrics(ev.reference, ev),
        "reference_cells": _cells(ev.reference, ev),
        "dtypes": {run.dtype: {"metrics": metrics(run, ev), "regression": regressions(run, ev),
                               "cells": _cells(run, ev)} for run in ev.runs},
        "gate": {"serving": serving, "max_regression": max_regression,
                 "passed": not failures, "failures": [str(f) for f in failures]},
    }


def _cells(run: DtypeRun, ev: EvalRun) -> list[dict[str, Any]]:
    return [{"task": p.task, "context": p.context, "label": p.label, "answer": p.answer,
             "output": out, "correct": hit}
            for p, hit, out in zip(ev.probes, run.hits, run.outputs)]


_COLUMNS = ("kv dtype", "perplexity", "ppl regr %", "KL nats", "top-1 %", *TASKS)


def table_rows(ev: EvalRun) -> list[list[str]]:
    rows = []
    for run in [ev.reference, *ev.runs]:
        m, r = metrics(run, ev), regressions(run, ev)
        name = f"{run.dtype} (reference)" if run is ev.reference else run.dtype
        tasks = [_task_cell(m[t], r.get(t), run is ev.reference) for t in TASKS]
        rows.append([name, f"{m['perplexity']:.3f}", f"{r['perplexity']:+.2f}",
                     f"{m['kl']:.5f}", f"{m['top1_agreement']:.2f}", *tasks])
    return rows


def _task_cell(accuracy: float | None, regression: float | None, is_reference: bool) -> str:
    if accuracy is None:
        return "-"
    return f"{accuracy:.0f}" if is_reference else f"{accuracy:.0f} ({(-regression) or 0.0:+.0f})"


def markdown(ev: EvalRun) -> str:
    lines = ["| " + " | ".join(_COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(ev)]
    return "\n".join(lines)


def text_table(ev: EvalRun) -> str:
    rows = [list(_COLUMNS), *table_rows(ev)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)
