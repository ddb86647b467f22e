"""Turn an :class:`EvalRun` into metrics, regressions against the reference, the gate
verdict, and a table as text, markdown or JSON."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from slimkv.eval.harness import TASKS, DtypeRun, EvalRun
from slimkv.eval.stats import RESAMPLES, SEED, Interval, McNemar, mcnemar, paired_bootstrap

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


def intervals(run: DtypeRun, ev: EvalRun, above_floor: bool = False) -> dict[str, Interval]:
    """Perplexity change (% of the reference's), mean KL and top-1 agreement (%) with
    paired bootstrap 95% intervals over the corpus windows; with ``above_floor``, each
    minus the floor run's on the same resampled windows."""
    floor = ev.floor.windows if above_floor and ev.floor is not None else None
    return paired_bootstrap(ev.reference.windows, run.windows, floor)


def mcnemars(run: DtypeRun, ev: EvalRun) -> dict[str, McNemar]:
    """Per task, probes the reference answers and ``run`` misses (b) and the reverse (c)."""
    out = {}
    for task in TASKS:
        pairs = [(r, m) for p, r, m in zip(ev.probes, ev.reference.hits, run.hits)
                 if p.task == task]
        if pairs:
            out[task] = mcnemar([r for r, _ in pairs], [m for _, m in pairs])
    return out


def _passkey_cells(run: DtypeRun, ev: EvalRun) -> dict[str, dict[str, int]]:
    """Per passkey (context, placement) cell: keys found by the reference and by ``run``,
    and the McNemar counts."""
    cells: dict[str, dict[str, int]] = {}
    for p, r, m in zip(ev.probes, ev.reference.hits, run.hits):
        if p.task == "passkey":
            cell = cells.setdefault(f"{p.context}/{p.label}",
                                    {"keys": 0, "reference": 0, "found": 0, "b": 0, "c": 0})
            cell["keys"] += 1
            cell["reference"] += r
            cell["found"] += m
            cell["b"] += r and not m
            cell["c"] += m and not r
    return cells


def _statistics(run: DtypeRun, ev: EvalRun) -> dict[str, Any]:
    floor = ev.floor is not None and run is not ev.floor
    return {"intervals": {k: v.to_dict() for k, v in intervals(run, ev).items()},
            "above_floor": ({k: v.to_dict() for k, v in intervals(run, ev, True).items()}
                            if floor else None),
            "mcnemar": {k: v.to_dict() for k, v in mcnemars(run, ev).items()},
            "passkey_cells": _passkey_cells(run, ev)}


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
        "windows": len(ev.reference.windows), "scored_tokens": ev.reference.stats.tokens,
        "strided": bool(ev.suite.strided_windows),
        "bootstrap": {"resamples": RESAMPLES, "seed": SEED, "level": 0.95, "paired": True},
        "floor": ev.floor.dtype if ev.floor is not None else None,
        "reference_metrics": metrics(ev.reference, ev),
        "reference_cells": _cells(ev.reference, ev),
        "dtypes": {run.dtype: {"metrics": metrics(run, ev), "regression": regressions(run, ev),
                               **_statistics(run, ev), "cells": _cells(run, ev)}
                   for run in ev.runs},
        "gate": {"serving": serving, "max_regression": max_regression,
                 "passed": not failures, "failures": [str(f) for f in failures]},
    }


def _cells(run: DtypeRun, ev: EvalRun) -> list[dict[str, Any]]:
    return [{"task": p.task, "context": p.context, "label": p.label, "answer": p.answer,
             "output": out, "correct": hit}
            for p, hit, out in zip(ev.probes, run.hits, run.outputs)]


_COLUMNS = ("kv dtype", "perplexity", "ppl change [95% CI]", "KL nats [95% CI]",
            "top-1 % [95% CI]", *TASKS, "passkey b/c (p)")
_FLOOR_COLUMNS = ("ppl above floor", "KL above floor", "top-1 above floor")


def columns(ev: EvalRun) -> list[str]:
    return [*_COLUMNS, *(_FLOOR_COLUMNS if ev.floor is not None else ())]


def _ci(i: Interval, fmt: str, unit: str = "") -> str:
    return f"{i.value:{fmt}}{unit} [{i.low:{fmt}}, {i.high:{fmt}}]"


def _ci_cells(iv: dict[str, Interval], sign: str = "") -> list[str]:
    return [_ci(iv["ppl_change_pct"], "+.2f", "%"), _ci(iv["kl"], sign + ".2e"),
            _ci(iv["top1_agreement"], sign + ".2f")]


def table_rows(ev: EvalRun) -> list[list[str]]:
    rows = []
    for run in [ev.reference, *ev.runs]:
        m, r = metrics(run, ev), regressions(run, ev)
        is_ref = run is ev.reference
        name = f"{run.dtype} (reference)" if is_ref else run.dtype
        tasks = [_task_cell(m[t], r.get(t), is_ref) for t in TASKS]
        test = mcnemars(run, ev).get("passkey")
        mc = "-" if is_ref or test is None else f"{test.b}/{test.c} (p={test.p_value:.3g})"
        row = [name, f"{m['perplexity']:.3f}", *_ci_cells(intervals(run, ev)), *tasks, mc]
        if ev.floor is not None:
            below = is_ref or run is ev.floor
            row += ["-"] * 3 if below else _ci_cells(intervals(run, ev, True), "+")
        rows.append(row)
    return rows


def _task_cell(accuracy: float | None, regression: float | None, is_reference: bool) -> str:
    if accuracy is None:
        return "-"
    return f"{accuracy:.0f}" if is_reference else f"{accuracy:.0f} ({(-regression) or 0.0:+.0f})"


def markdown(ev: EvalRun) -> str:
    cols = columns(ev)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(ev)]
    return "\n".join(lines)


def text_table(ev: EvalRun) -> str:
    rows = [columns(ev), *table_rows(ev)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows)
