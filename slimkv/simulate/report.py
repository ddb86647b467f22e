"""``bench/simulate/results.md`` and its plots from the simulator's JSON files (every number
is read from them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slimkv.loadtest.report import save_figure


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def case_table(case: dict[str, Any]) -> list[str]:
    spec = case["spec"]
    base = case["variants"][0]["sessions_served"] or 1
    lines = [f"### {spec['model']} on {spec['device']}, {spec['context']}-token sessions "
             f"({spec['doc_tokens']}-token document, {spec['max_tokens']} tokens per turn)", "",
             "| KV cache | KiB/token | blocks | sessions served | vs bf16 contiguous | limited by "
             "| P99 TTFT flat (<=2x) up to | P50 / P99 TTFT at 24 (s) | at 48 (s) | TPOT P50 at 48 (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for v in case["variants"]:
        at = {lv["concurrency"]: lv for lv in v["levels"]}
        l24, l48 = at.get(24), at.get(48)
        lines.append(
            f"| {v['variant']} | {v['kv_kib_per_token']} | {v['num_blocks']} | "
            f"{v['sessions_served']} | x{v['sessions_served'] / base:.2f} | {v['limited_by']} | "
            f"{v['p99_ttft_flat_up_to'] or '-'} | "
            + (f"{_s(l24['ttft_s']['p50'])} / {_s(l24['ttft_s']['p99'])} | " if l24 else "- | ")
            + (f"{_s(l48['ttft_s']['p50'])} / {_s(l48['ttft_s']['p99'])} | "
               f"{_ms(l48['tpot_s']['p50'])} |" if l48 else "- | - |"))
    lines += ["", f"P99 TTFT (s) per concurrency level:", "",
              "| KV cache | " + " | ".join(str(c) for c in spec["levels"]) + " |",
              "|---|" + "---|" * len(spec["levels"])]
    for v in case["variants"]:
        lines.append(f"| {v['variant']} | " + " | ".join(
            f"{_s(lv['ttft_s']['p99'])} ({lv['peak_running']})" for lv in v["levels"]) + " |")
    lines += ["", "(in brackets: the most sessions running at once)", ""]
    if not case["policies"]:
        return lines
    lines += [f"What each policy changes, at {case['policies'][0]['concurrency']} clients:", "",
              "| configuration | sessions running (peak) | KV peak | preemptions "
              "| P50 / P99 TTFT (s) | TPOT P50 (ms) | out tok/s |", "|---|---|---|---|---|---|---|"]
    for p in case["policies"]:
        lines.append(f"| {p['policy']} | {p['peak_running']} | {p['peak_kv_usage']:.0%} | "
                     f"{p['preemptions']} | {_s(p['ttft_s']['p50'])} / {_s(p['ttft_s']['p99'])} "
                     f"| {_ms(p['tpot_s']['p50'])} | {p['out_tok_s']:.0f} |")
    return lines + [""]


def calibration_table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| KV cache | fit on / test on (clients) | fitted: overhead ms, per-seq ms, GB/s, "
             "TFLOPS, attention ns/pair | step error held out: decode median (P90) | all steps median (P90) "
             "| decode step P50 measured / predicted (ms) | TTFT P50 measured / predicted (s) "
             "| TTFT P99 measured / predicted (s) |", "|---|---|---|---|---|---|---|---|"]
    for r in runs:
        f, e, m, p = r["fitted"], r["step_error_test"], r["measured"], r["predicted"]
        lines.append(
            f"| {r['kv_dtype']} | {r['fit_level']} / {r['test_level']} | {f['overhead_ms']}, "
            f"{f['per_seq_ms']}, {f['bandwidth_gbps']}, {f['tflops']}, "
            f"{f.get('attn_ns_per_pair', '-')} | "
            f"{e['decode'].get('median', 0):.1%} ({e['decode'].get('p90', 0):.1%}) | "
            f"{e['all']['median']:.1%} ({e['all']['p90']:.1%}) | "
            f"{_ms(m['decode_step_s']['p50'])} / {_ms(p['decode_step_s']['p50'])} | "
            f"{_s(m['ttft_s']['p50'])} / {_s(p['ttft_s']['p50'])} | "
            f"{_s(m['ttft_s']['p99'])} / {_s(p['ttft_s']['p99'])} |")
    return lines + [""]


def fleet_table(fleet: dict[str, Any]) -> list[str]:
    lines = [f"SLO: P99 TTFT <= {fleet['slo_s']} s; users think {fleet['think_time']} s "
             f"(0.5-1.5x) between turns; {fleet['duration']} s simulated, the first "
             f"{fleet['warmup']} s not measured.", "",
             "| KV cache | sessions | cards | sessions per card | meets SLO | P99 TTFT (s) "
             "| TPOT P50 (ms) | peak running per card | routed: session / load / kv "
             "| wall time (s) | bisection: cards (P99 TTFT s) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in fleet["rows"]:
        r = row["result"]
        reasons = r["route_reasons"]
        lines.append(
            f"| {row['variant']} | {row['sessions']} | {row['cards']} | "
            f"{row['sessions'] / row['cards']:.0f} | {'yes' if row['meets_slo'] else 'no'} | "
            f"{_s(r['ttft_s']['p99'])} | "
            f"{_ms(r['tpot_s']['p50'])} | {r['peak_running_per_replica']} | "
            f"{reasons.get('session', 0)} / {reasons.get('load', 0)} / {reasons.get('kv', 0)} "
            f"| {r['wall_s']} | "
            + ", ".join(f"{t['cards']} ({_s(t['p99_ttft_s'])})" for t in row["bisection"])
            + " |")
    return lines + [""]


def plot_case(case: dict[str, Any], path: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for v in case["variants"]:
        cs = [lv["concurrency"] for lv in v["levels"]]
        a.plot(cs, [lv["peak_running"] for lv in v["levels"]], marker="o", label=v["variant"])
        b.plot(cs, [lv["ttft_s"]["p99"] for lv in v["levels"]], marker="o", label=v["variant"])
    spec = case["spec"]
    a.set(xlabel="clients", ylabel="sessions running at once (peak)",
          title=f"{spec['model']} on {spec['device']}, {spec['context']} tokens")
    b.set(xlabel="clients", ylabel="P99 TTFT (s)", yscale="log", title="P99 time to first token")
    save_figure(fig, (a, b), path, legend_size=8)
    return path


def plot_fleet(fleet: dict[str, Any], path: Path) -> Path:
    """P99 TTFT against sessions per card, per KV dtype: every fleet run (bisection
    included), the SLO as a line."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for variant in sorted({r["variant"] for r in fleet["rows"]}):
        rows = [r for r in fleet["rows"] if r["variant"] == variant]
        for n in sorted({r["sessions"] for r in rows}):
            pts = {t["cards"]: t["p99_ttft_s"] for r in rows if r["sessions"] == n
                   for t in r["bisection"]}
            pts |= {r["cards"]: r["result"]["ttft_s"]["p99"] for r in rows if r["sessions"] == n}
            xs = sorted(pts, reverse=True)
            ax.plot([n / c for c in xs], [pts[c] for c in xs], marker="o",
                    label=f"{variant}, {n} sessions")
    ax.axhline(fleet["slo_s"], color="grey", linestyle="--", label=f"SLO {fleet['slo_s']} s")
    ax.set(xlabel="sessions per card", ylabel="P99 TTFT (s)", yscale="log",
           title=f"{fleet['model']} on {fleet['device']} replicas, think {fleet['think_time']} s")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_results(out_dir: Path) -> list[Path]:
    """Render ``results.md`` (and the case plots) from whatever JSON ``out_dir`` holds."""
    import json

    lines = ["# Capacity simulator results", "",
             "_Generated by `slimkv bench simulate report` from the JSON beside it; "
             "method and reading in docs/capacity.md._", ""]
    written = []
    cal = out_dir / "calibration.json"
    if cal.is_file():
        data = json.loads(cal.read_text())
        lines += ["## Calibration on this CPU (the real engine vs the simulator)", "",
                  f"`{data['command']}`", ""] + calibration_table(data["runs"])
        lines += [f"- {r['kv_dtype']}: `{r['command']}` ({r['machine'].get('date', '')})"
                  for r in data["runs"] if "command" in r] + [""]
    for path in sorted(out_dir.glob("case-*.json")):
        case = json.loads(path.read_text())
        png = plot_case(case, path.with_suffix(".png"))
        written.append(png)
        runs = case.get("pieces") or [{"command": case["command"], "elapsed_s": case["elapsed_s"]}]
        lines += ["## " + path.stem, ""] + [f"`{r['command']}` (took {r['elapsed_s']} s)  "
                                            for r in runs] + [""] + case_table(case) + [f"![{path.stem}]({png.name})", ""]
    for fleet in sorted(out_dir.glob("fleet-*.json")):
        data = json.loads(fleet.read_text())
        png = plot_fleet(data, fleet.with_suffix(".png"))
        written.append(png)
        commands = dict.fromkeys(r.get("command", data["command"]) for r in data["rows"])
        lines += [f"## Fleet: {data['model']} on {data['device']} replicas", ""]
        lines += [f"`{c}`  " for c in commands] + [""] + fleet_table(data)
        lines += [f"![{fleet.stem}]({png.name})", ""]
    out = out_dir / "results.md"
    out.write_text("\n".join(lines) + "\n")
    return written + [out]
