"""The soak's PNG: the overload timeline (responses per outcome and TTFT), the server's
memory, the replica-kill TTFTs (warm, re-routed with the shared tier, recompute) and the
verdicts with the crash phase's counts."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from slimkv.workload import percentile

BUCKET_S = 30.0
COLORS = {"ok": "#2a7", "busy": "#e90", "other": "#c33"}


def _overload(ax, o: dict[str, Any]) -> None:
    counts: dict[int, Counter[str]] = defaultdict(Counter)
    ttfts: dict[int, list[float]] = defaultdict(list)
    for r in o["timeline"]:
        b = int(r["t"] // BUCKET_S)
        kind = r["outcome"] if r["outcome"] in ("ok", "busy") else "other"
        counts[b][kind] += 1
        if r["ttft"] is not None:
            ttfts[b].append(r["ttft"])
    xs = sorted(counts)
    bottom = [0] * len(xs)
    for kind, color in COLORS.items():
        ys = [counts[x][kind] for x in xs]
        ax.bar([x * BUCKET_S / 60 for x in xs], ys, BUCKET_S / 60 * 0.9, bottom=bottom,
               color=color, label={"ok": "200", "busy": "429 + Retry-After",
                                   "other": "anything else"}[kind], align="edge")
        bottom = [a + b for a, b in zip(bottom, ys)]
    ax.set_xlabel("minutes")
    ax.set_ylabel(f"responses per {BUCKET_S:g} s")
    right = ax.twinx()
    right.plot([(x + 0.5) * BUCKET_S / 60 for x in xs],
               [percentile(ttfts[x], 50) or 0 for x in xs], "k.-", label="TTFT P50 (200s)")
    right.set_ylabel("TTFT P50 (s)")
    ax.legend(loc="upper left", fontsize=7)
    right.legend(loc="upper right", fontsize=7)
    s = o["spec"]
    ax.set_title(f"overload: {s['clients']} clients, soft limit {s['soft_limit']}, "
                 f"queue {s['max_queue']}", fontsize=9)


def _memory(ax, o: dict[str, Any]) -> None:
    samples = o["rss_samples"]
    ax.plot([t / 60 for t, _ in samples], [mb for _, mb in samples], "b.-")
    rss = o["rss"]
    if rss.get("base_mb"):
        ax.axhline(rss["base_mb"] * 1.05, color="#c33", ls="--", lw=1, label="+5% of minute 2")
        ax.axvline(rss["from_s"] / 60, color="#888", ls=":", lw=1)
        ax.legend(fontsize=7)
    ax.set_xlabel("minutes")
    ax.set_ylabel("server RSS (MiB)")
    ax.set_title(f"memory: growth {rss.get('growth')}", fontsize=9)


def _kills(ax, k: dict[str, Any]) -> None:
    rounds = [r for r in k["rounds"] if "error" not in r]
    labels = ("warm", "reroute", "recompute")
    names = {"warm": "warm (prefix in pool)", "reroute": "re-routed: reload from shared tier",
             "recompute": "recompute (nothing cached)"}
    width = 0.27
    for i, key in enumerate(labels):
        ax.bar([j + (i - 1) * width for j in range(len(rounds))],
               [r[key]["ttft_s"] or 0 for r in rounds], width, label=names[key])
    ax.set_xticks(range(len(rounds)), [f"kill {r['round'] + 1}" for r in rounds])
    ax.set_ylabel("TTFT (s)")
    ax.legend(fontsize=7)
    p = k["ttft_p50_s"]
    ax.set_title(f"replica kills: TTFT P50 warm {p['warm']} s, re-route {p['reroute_reload']} s, "
                 f"recompute {p['recompute']} s", fontsize=9)


def _verdicts(ax, result: dict[str, Any]) -> None:
    ax.axis("off")
    lines = [f"{'met ' if ok else 'MISSED'}  {name}" for name, ok in result["verdicts"].items()]
    c = result.get("crash")
    if c:
        a = c["audit_after_kill"]
        lines += ["", f"crash: killed mid-write {c['killed_mid_write']}, after "
                  f"{c['turns_before_kill']} turns; audit {a['chunks']} chunks, {a['bad']} bad, "
                  f"{a['tmp']} tmp", f"damaged on purpose {len(c['damaged_on_purpose'])}, "
                  f"corrupt blocks counted {c['corrupt_blocks_after_replay']:g}; turns equal "
                  f"{c['turns_equal']}/{c['turns_compared']}"]
    ax.text(0, 1, "\n".join(lines), va="top", family="monospace", fontsize=8)
    ax.set_title("verdicts", fontsize=9)


def plot_soak(result: dict[str, Any], path: str | Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    for ax, (phase, draw) in zip(axes.flat[:3], (("overload", _overload),
                                                 ("overload", _memory), ("kills", _kills))):
        if "error" not in result.get(phase, {"error": "not run"}):
            draw(ax, result[phase])
        else:
            ax.axis("off")
    _verdicts(axes.flat[3], result)
    fig.suptitle(f"slimkv bench soak: {result['machine']['cpu']}, {result['seconds']:g} s",
                 fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
