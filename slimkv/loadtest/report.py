"""From raw request results to the numbers a load test reports: percentiles, throughput,
errors by kind; and a table and a plot over concurrency levels."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from slimkv.loadtest.client import RequestResult
from slimkv.loadtest.runner import LevelRun
from slimkv.workload import percentile

Summary = dict[str, Any]


def _quantiles(values: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
    return {f"p{q}": _round(percentile(values, q)) for q in qs}


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summarize(run: LevelRun) -> Summary:
    """One level's statistics over the requests started after the warm-up."""
    measured = run.measured
    completed = [r for r in measured if r.ok]
    window = max(1e-9, run.end - (run.start + run.warmup))
    first = run.start + run.warmup
    output_tokens = sum(_tokens_after(r, first) for r in run.results)
    prompt_tokens = sum(r.prompt_tokens or 0 for r in completed)
    return {
        "concurrency": run.concurrency,
        "window_s": round(window, 2),
        "requests_sent": len(measured),
        "requests_completed": len(completed),
        "requests_cancelled_at_end": sum(r.cancelled for r in measured),
        "errors": dict(Counter(r.error for r in measured if r.error)),
        "error_count": sum(1 for r in measured if r.error),
        "requests_unserved_at_end": sum(r.cancelled and r.ttft is None for r in measured),
        "ttft_s": _quantiles(_first_token_waits(measured), (50, 90, 99)),
        "itl_s": _quantiles([g for r in measured for g in r.inter_token_latencies()], (50, 99)),
        "e2e_s": _quantiles([r.end - r.start for r in completed], (50, 90, 99)),
        "output_tokens_per_s": round(output_tokens / window, 2),
        "total_tokens_per_s": round((output_tokens + prompt_tokens) / window, 2),
        "mean_prompt_tokens": _round(prompt_tokens / len(completed), 1) if completed else None,
    }


def _first_token_waits(results: list[RequestResult]) -> list[float]:
    """TTFTs, plus the wait so far of requests the window ended before their first token
    (a lower bound): leaving them out would make an overloaded level look faster."""
    return [r.ttft if r.ttft is not None else r.end - r.start
            for r in results if r.ttft is not None or r.cancelled]


def _tokens_after(result: RequestResult, since: float) -> float:
    """Tokens received from ``since`` on (chunks scaled to the reported token count)."""
    per_chunk = result.output_tokens / max(1, len(result.chunk_times))
    return per_chunk * sum(1 for t in result.chunk_times if t >= since)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


def format_table(levels: list[Summary]) -> str:
    """A fixed-width text table, one row per concurrency level (latencies in ms)."""
    header = (f"{'conc':>5} {'done':>6} {'err':>5} {'ttft50':>7} {'ttft90':>7} {'ttft99':>7} "
              f"{'itl50':>6} {'itl99':>6} {'e2e50':>7} {'e2e99':>7} {'out/s':>7} {'tot/s':>8}")
    rows = [header]
    for s in levels:
        t, i, e = s["ttft_s"], s["itl_s"], s["e2e_s"]
        rows.append(f"{s['concurrency']:>5} {s['requests_completed']:>6} {s['error_count']:>5} "
                    f"{_ms(t['p50']):>7} {_ms(t['p90']):>7} {_ms(t['p99']):>7} "
                    f"{_ms(i['p50']):>6} {_ms(i['p99']):>6} {_ms(e['p50']):>7} {_ms(e['p99']):>7} "
                    f"{s['output_tokens_per_s']:>7.1f} {s['total_tokens_per_s']:>8.1f}")
    errors = Counter()
    for s in levels:
        errors.update(s["errors"])
    if errors:
        rows.append("errors: " + ", ".join(f"{k}={v}" for k, v in sorted(errors.items())))
    return "\n".join(rows)


def plot_levels(series: dict[str, list[Summary]], path: str | Path, title: str) -> None:
    """TTFT P50/P99 and output tokens/s against concurrency, one line per series."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_ttft, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, levels in series.items():
        xs = [s["concurrency"] for s in levels]
        line, = ax_ttft.plot(xs, [s["ttft_s"]["p99"] for s in levels], marker="o",
                             label=f"{name} P99")
        ax_ttft.plot(xs, [s["ttft_s"]["p50"] for s in levels], linestyle="--",
                     color=line.get_color(), label=f"{name} P50")
        ax_tps.plot(xs, [s["output_tokens_per_s"] for s in levels], marker="o", label=name)
    ax_ttft.set(xlabel="concurrent clients", ylabel="TTFT (s)", title="time to first token")
    ax_tps.set(xlabel="concurrent clients", ylabel="output tokens/s", title="throughput")
    fig.suptitle(title)
    save_figure(fig, (ax_ttft, ax_tps), path, legend_size=7)


def save_figure(fig: Any, axes: tuple, path: str | Path, legend_size: int) -> None:
    """What every report figure ends with: grid and legend on each axis, tight layout,
    written as a 110-dpi PNG (parent folders made) and closed."""
    import matplotlib.pyplot as plt

    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_size)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
