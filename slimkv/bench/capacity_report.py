"""From the capacity sweep's JSON to ``REPORT.md`` and its plots, in the shape of the
case's own table: sessions before/after, memory change, how far P99 TTFT stays flat, and
what happens past the soft limit. Every number is read from the measured JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from slimkv.loadtest.report import plot_levels, save_figure

STORM_SHARE = 0.1    # preemptions above this share of requests sent: a preemption storm
FLAT_FACTOR = 2.0    # "flat": P99 TTFT within this factor of the lowest level's
MiB = 1024 ** 2


def censored(level: dict[str, Any]) -> bool:
    """Over 1% of the level's requests had no first token when its window closed, so its
    P99 TTFT is a lower bound (their waits so far)."""
    return level["requests_unserved_at_end"] > 0.01 * max(1, level["requests_sent"])


def is_clean(level: dict[str, Any]) -> bool:
    return (level["error_count"] == 0
            and level["server"]["preemptions"] <= STORM_SHARE * max(1, level["requests_sent"]))


def sessions_served(levels: list[dict[str, Any]]) -> int:
    """The most requests the server ran at once in a level without errors or a storm."""
    return max((lv["server"]["peak_running"] for lv in levels if is_clean(lv)), default=0)


def limited_by(levels: list[dict[str, Any]], sessions: int, soft: int, watermark: float) -> str:
    """Why no more ran at once: the soft limit, the KV watermark, or, with neither reached
    while requests queued, the compute that admits (prefills) them within the window."""
    if sessions >= soft:
        return "soft limit"
    usage = max(lv["server"]["peak_kv_blocks_used"] / lv["server"]["kv_blocks_total"]
                for lv in levels)
    if usage >= watermark:
        return "KV memory (watermark)"
    if any(lv["server"]["peak_waiting"] and lv["server"]["peak_running"] < lv["concurrency"]
           for lv in levels):
        return f"compute (KV peak {usage:.0%})"
    return "offered load"


def flat_up_to(levels: list[dict[str, Any]]) -> int | None:
    base = levels[0]["ttft_s"]["p99"]
    flat = None
    for lv in levels:
        p99 = lv["ttft_s"]["p99"]
        if base is None or p99 is None or p99 > FLAT_FACTOR * base or censored(lv):
            break
        flat = lv["concurrency"]
    return flat


def past_soft_limit(levels: list[dict[str, Any]], soft: int) -> dict[str, Any] | None:
    over = [lv for lv in levels if lv["concurrency"] > soft]
    under = [lv for lv in levels if lv["concurrency"] <= soft]
    if not over or not under:
        return None
    a, b = under[-1], over[-1]
    slope = None
    if a["ttft_s"]["p99"] is not None and b["ttft_s"]["p99"] is not None:
        slope = (b["ttft_s"]["p99"] - a["ttft_s"]["p99"]) / (b["concurrency"] - a["concurrency"])
    return {"errors": sum(lv["error_count"] for lv in over),
            "peak_waiting": max(lv["server"]["peak_waiting"] for lv in over),
            "p99_slope_s_per_session": slope, "p99_last_s": b["ttft_s"]["p99"],
            "censored": censored(a) or censored(b), "levels": [lv["concurrency"] for lv in over]}


def analyze(result: dict[str, Any]) -> list[dict[str, Any]]:
    soft, watermark = result["config"]["max_concurrency_soft"], result["config"]["watermark"]
    variants = result["variants"]
    base_sessions = sessions_served(variants[0]["levels"])
    ref = max((c for c in result["spec"]["levels"] if c <= base_sessions),
              default=result["spec"]["levels"][0])
    rows = []
    for v in variants:
        levels = v["levels"]
        sessions = sessions_served(levels)
        at_ref = next(lv for lv in levels if lv["concurrency"] == ref)
        rows.append({"variant": v["variant"], "sessions": sessions,
                     "bits_per_element": v.get("bits_per_element"),  # older results lack it
                     "limited_by": limited_by(levels, sessions, soft, watermark), "ref_level": ref,
                     "kv_bytes_at_ref": at_ref["server"]["peak_kv_bytes_used"],
                     "flat_up_to": flat_up_to(levels), "past_soft": past_soft_limit(levels, soft),
                     "errors": sum(lv["error_count"] for lv in levels),
                     "preemptions": sum(lv["server"]["preemptions"] for lv in levels)})
    base = rows[0]
    for row in rows:
        row["sessions_x"] = row["sessions"] / base["sessions"] if base["sessions"] else None
        row["memory_change"] = (row["kv_bytes_at_ref"] / base["kv_bytes_at_ref"] - 1
                                if base["kv_bytes_at_ref"] else None)
    return rows


def _fmt_past(past: dict[str, Any] | None) -> str:
    if past is None:
        return "not reached"
    slope = past["p99_slope_s_per_session"]
    if past["censored"]:
        slope_text = f">= {past['p99_last_s']:.1f} s (cut off by the window)"
    else:
        slope_text = "-" if slope is None else f"{slope * 1000:+.0f} ms/session"
    return f"{past['errors']} errors, up to {past['peak_waiting']} queued, P99 TTFT {slope_text}"


def summary_table(rows: list[dict[str, Any]]) -> str:
    ref = rows[0]["ref_level"]
    lines = [f"| KV cache | bits / element | sessions served | vs baseline | limited by | KV in "
             f"use at {ref} clients | memory change | P99 TTFT flat (<= 2x) up to | past the "
             "soft limit |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        x = "-" if r["sessions_x"] is None else f"x{r['sessions_x']:.2f}"
        mem = "-" if r["memory_change"] is None else f"{r['memory_change'] * 100:+.0f}%"
        flat = "-" if r["flat_up_to"] is None else f"{r['flat_up_to']} clients"
        bits = "-" if r.get("bits_per_element") is None else f"{r['bits_per_element']:.2f}"
        lines.append(f"| {r['variant']} | {bits} | {r['sessions']} | {x} | {r['limited_by']} | "
                     f"{r['kv_bytes_at_ref'] / MiB:.1f} MiB | {mem} | {flat} | "
                     f"{_fmt_past(r['past_soft'])} |")
    return "\n".join(lines)


def level_table(variant: dict[str, Any]) -> str:
    lines = ["| clients | running (peak/mean) | queued (peak) | KV in use | preemptions | "
             "requests done | no first token by the end | errors | TTFT P50 / P99 (s) | "
             "out tok/s | prefix hits |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in variant["levels"]:
        s, t = lv["server"], lv["ttft_s"]
        ttft = " / ".join("-" if x is None else f"{x:.2f}" for x in (t["p50"], t["p99"]))
        ttft = f">= {ttft}" if censored(lv) else ttft
        hits = s.get("prefix_hit_rate")  # older results lack it
        lines.append(f"| {lv['concurrency']} | {s['peak_running']} / {s['mean_running']} | "
                     f"{s['peak_waiting']} | {s['peak_kv_bytes_used'] / MiB:.1f} MiB "
                     f"({s['peak_kv_blocks_used']}/{s['kv_blocks_total']} blocks) | "
                     f"{s['preemptions']} | {lv['requests_completed']} | "
                     f"{lv['requests_unserved_at_end']} | {lv['error_count']} | "
                     f"{ttft} | {lv['output_tokens_per_s']:.1f} | "
                     f"{'-' if hits is None else f'{hits:.0%}'} |")
    return "\n".join(lines)


def plot_capacity(result: dict[str, Any], path: Path) -> None:
    """Requests the server ran at once, and KV in use, against offered concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_run, ax_kv) = plt.subplots(1, 2, figsize=(11, 4.2))
    for v in result["variants"]:
        xs = [lv["concurrency"] for lv in v["levels"]]
        ax_run.plot(xs, [lv["server"]["peak_running"] for lv in v["levels"]], marker="o",
                    label=v["variant"])
        ax_kv.plot(xs, [lv["server"]["peak_kv_bytes_used"] / MiB for lv in v["levels"]],
                   marker="o", label=v["variant"])
    xs = result["spec"]["levels"]
    ax_run.plot(xs, xs, color="grey", linestyle=":", label="offered")
    ax_run.axhline(result["config"]["max_concurrency_soft"], color="red", linestyle="--",
                   linewidth=0.8, label="soft limit")
    ax_kv.axhline(result["budget_bytes"] / MiB, color="red", linestyle="--", linewidth=0.8,
                  label="KV budget")
    ax_run.set(xlabel="concurrent sessions offered", ylabel="running (peak)",
               title="sessions served at once")
    ax_kv.set(xlabel="concurrent sessions offered", ylabel="MiB", title="KV cache in use (peak)")
    save_figure(fig, (ax_run, ax_kv), path, legend_size=7)


def render(result: dict[str, Any], rows: list[dict[str, Any]], command: str) -> str:
    spec, cfg, m = result["spec"], result["config"], result["machine"]
    base, int8 = rows[0], next((r for r in rows if r["variant"] == "int8 paged"), None)
    parts = [
        "# Capacity report: the case's experiment at this machine's scale",
        "",
        "_Generated by `slimkv bench capacity` from `bench/capacity/capacity.json`; do not edit._",
        "",
        f"Every variant gets the same KV budget, **{result['budget_bytes'] / MiB:.1f} MiB**: "
        f"what lets the bfloat16 contiguous engine admit {spec['sessions']} sessions of "
        f"{spec['context']} tokens under the {cfg['watermark']:.0%} watermark (each "
        f"contiguous request reserves `max_model_len` = {spec['context']} tokens). Each "
        f"variant runs in its own `slimkv serve`; a closed loop of long sessions (a "
        f"~{spec['doc_tokens']}-token document, then turn after turn of {spec['max_tokens']} "
        f"generated tokens until the session reaches {spec['context']} tokens, then a new "
        f"session) runs {spec['duration']:g} s per level while `/metrics` is sampled.",
        "",
        summary_table(rows),
        "",
    ]
    if result.get("parts"):
        from slimkv.bench.capacity_targets import targets_section
        parts += targets_section(result, rows)
    if int8 is not None and base["sessions"]:
        parts += [f"**Sessions, bf16 contiguous -> int8 paged: {base['sessions']} -> "
                  f"{int8['sessions']} (x{int8['sessions_x']:.2f}); KV in use at "
                  f"{base['ref_level']} clients {int8['memory_change'] * 100:+.0f}%.** "
                  "The case reported about 24 -> 52 (x2.2) and about -40% memory.", ""]
    parts += [
        "How to read it: *sessions served* is the most requests the server ran at once "
        f"(peak `num_requests_running`) at a level with no errors and preemptions under "
        f"{STORM_SHARE:.0%} of requests; *limited by* says whether the KV budget (usage "
        f"reached the watermark), the soft limit (`max_concurrency_soft` = "
        f"{cfg['max_concurrency_soft']}), the CPU (requests still queued for prefill while "
        "KV was below the watermark) or the offered load stopped it; *memory change* "
        "compares the KV blocks in use at the same load; *flat* means P99 TTFT within "
        f"{FLAT_FACTOR:g}x of the lowest level's. A request still waiting for its first "
        "token when a level's window closes counts in TTFT with its wait so far, so "
        "overload is not hidden; where over 1% did, the TTFT shown is a lower bound (>=).",
        "",
        "![sessions served and KV in use](capacity/capacity.png)",
        "",
        "![TTFT and throughput](capacity/ttft.png)",
        "",
        "## Scale and caveats",
        "",
        f"- Machine: {m['cpu']}, {m['torch_threads']} torch threads, torch {m['torch']}, no GPU; "
        f"finished {m['date']}, took {result['elapsed_s'] / 60:.1f} min. Latencies depend on what else the "
        "CPU runs; the sessions and memory columns come from the server's own "
        "block accounting and do not depend on speed.",
        "- The model is the embedded SmolLM2-135M-Instruct on CPU, so compute, not memory "
        "bandwidth, sets the latencies: TTFT grows with concurrency on every variant, and the "
        "case's INT8 bandwidth win cannot show here. Contiguous allocation also cannot use "
        "the prefix cache, so each of its turns re-reads the whole history.",
        "- The watermark is checked once per scheduler step, so a step can admit a request "
        "or two past it: the baseline can serve a little more than the sessions it was sized "
        "for. Variants marked *compute* still had KV to spare; on this CPU the window ended "
        "before more sessions were prefilled (fp8 and int4 ran slower than int8 here; see out tok/s).",
        f"- Config: block_size {cfg['block_size']}, max_num_batched_tokens "
        f"{cfg['max_num_batched_tokens']}, the default scheduler; seed {spec['seed']}.",
        "",
        "## Per level",
        "",
    ]
    for v in result["variants"]:
        parts += [f"### {v['variant']}", "", level_table(v), ""]
    commands = [p["command"] for p in result.get("parts", ()) if p.get("command")] or [command]
    parts += ["## Reproduce", "", "```", *commands, "```", ""]
    return "\n".join(parts)


def write_report(result: dict[str, Any], report: Path, command: str) -> list[Path]:
    """``report`` (markdown) plus ``capacity/capacity.png`` and ``capacity/ttft.png`` beside it."""
    plots = report.parent / "capacity"
    plot_capacity(result, plots / "capacity.png")
    plot_levels({v["variant"]: v["levels"] for v in result["variants"]}, plots / "ttft.png",
                "long sessions, same KV budget")
    report.write_text(render(result, analyze(result), command))
    return [report, plots / "capacity.png", plots / "ttft.png"]
