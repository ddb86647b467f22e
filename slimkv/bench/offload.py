"""``slimkv bench offload``: multi-turn long-document sessions with more sessions than the
pool holds, the offload tier off (recompute), in host memory, or on disk.

Each session is a document of ``doc_tokens`` then ``turns`` turns of a short user message
and a short answer, the sessions taking turns round-robin: by the time a session comes
back, the others have pushed its blocks out of the pool (which holds about one session).
Per mode: TTFT of turns 2+ and the prompt tokens actually computed. After the disk run, a
new engine over the same directory continues every session (restart recovery), against a
turn whose prefix is still in the pool (warm).
"""

from __future__ import annotations

import dataclasses
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from slimkv.bench.engine import machine_info
from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.plugins import build_engine
from slimkv.engine.sampling import SamplingParams
from slimkv.stats import cdiv
from slimkv.workload import percentile

MODES = ("off", "host", "disk")


@dataclasses.dataclass
class Workload:
    doc_tokens: int
    turns: int = 6
    sessions: int = 4
    pool_sessions: int = 1
    user_tokens: int = 32
    answer_tokens: int = 16
    seed: int = 0

    def pool_blocks(self, block_size: int) -> int:
        session = self.doc_tokens + (self.turns + 2) * (self.user_tokens + self.answer_tokens)
        return self.pool_sessions * (cdiv(session, block_size) + 8)


def run_turn(engine: LLMEngine, prompt: list[int], session: int, answer: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=answer, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    seq = engine.add_request(prompt, params, session_id=f"s{session}")
    ttft = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.ttft is not None and ttft is None:
                ttft = time.perf_counter() - start
    return {"ttft": ttft, "prompt": len(prompt), "cached": seq.num_cached_tokens,
            "output": seq.output_token_ids}


def run_sessions(engine: LLMEngine, work: Workload, histories: list[list[int]],
                 turns: range, rng: random.Random) -> list[dict[str, Any]]:
    vocab = engine.model_args.vocab_size
    rows = []
    for turn in turns:
        for s, history in enumerate(histories):
            prompt = history + [rng.randrange(100, vocab) for _ in range(work.user_tokens)]
            row = run_turn(engine, prompt, s, work.answer_tokens)
            history[:] = prompt + row.pop("output")
            rows.append({"turn": turn, "session": s, **row})
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] >= 2]
    return {"turn2_p50_ttft_s": percentile([r["ttft"] for r in later], 50),
            "turn2_p90_ttft_s": percentile([r["ttft"] for r in later], 90),
            "turn1_p50_ttft_s": percentile([r["ttft"] for r in rows if r["turn"] == 1], 50),
            "turn2_prefill_tokens": sum(r["prompt"] - r["cached"] for r in later),
            "turn2_prompt_tokens": sum(r["prompt"] for r in later)}


def offload_for(mode: str, directory: str) -> dict[str, Any] | None:
    if mode == "off":
        return None
    if mode == "host":
        return {"host_gb": 1.0}
    return {"host_gb": 0, "disk_path": directory, "disk_gb": 4.0}


def bench_doc(config: Config, work: Workload) -> dict[str, Any]:
    kv = config.kv_cache
    base = config.replace("kv_cache", num_blocks=work.pool_blocks(kv.block_size),
                          memory_gb=None)
    out: dict[str, Any] = {"workload": dataclasses.asdict(work),
                           "num_blocks": base.kv_cache.num_blocks, "modes": {}}
    with tempfile.TemporaryDirectory(prefix="slimkv-offload-") as directory:
        for mode in MODES:
            mode_config = base.replace("kv_cache", offload=offload_for(mode, directory))
            engine = build_engine(mode_config)
            rng = random.Random(work.seed)
            vocab = engine.model_args.vocab_size
            histories = [[rng.randrange(100, vocab) for _ in range(work.doc_tokens)]
                         for _ in range(work.sessions)]
            rows = run_sessions(engine, work, histories, range(1, work.turns + 1), rng)
            out["modes"][mode] = {**summarize(rows), "offload": _tier_stats(engine),
                                  "turns": rows}
            if engine.connector is not None:
                engine.connector.close()
            if mode == "disk":
                out["restart"] = bench_restart(mode_config, work, histories, rng)
    return out


def bench_restart(config: Config, work: Workload, histories: list[list[int]],
                  rng: random.Random) -> dict[str, Any]:
    """A new engine over the disk directory: each session's next turn (restart), then one
    more right away (its prefix still in the pool: warm). One short unrelated request first
    warms the new process up (first-forward costs are not the tier's)."""
    engine = build_engine(config)
    run_turn(engine, [rng.randrange(100, engine.model_args.vocab_size) for _ in range(16)],
             -1, 2)
    restart, warm = [], []
    for s, history in enumerate(histories):
        for bucket in (restart, warm):
            rows = run_sessions(engine, work, [history], range(1), rng)
            bucket.append({**rows[0], "session": s})
    if engine.connector is not None:
        engine.connector.close()
    return {"restart_p50_ttft_s": percentile([r["ttft"] for r in restart], 50),
            "warm_p50_ttft_s": percentile([r["ttft"] for r in warm], 50),
            "restart": restart, "warm": warm}


def _tier_stats(engine: LLMEngine) -> dict[str, Any]:
    return {tier: dataclasses.asdict(t) for tier, t in engine.stats().offload.items()}


def bench_offload(config: Config, doc_tokens: list[int], **work: Any) -> dict[str, Any]:
    return {"machine": machine_info(), "model_dtype": config.model.dtype,
            "kv_dtype": config.kv_cache.dtype, "k_scale": config.kv_cache.k_scale,
            "docs": {str(n): bench_doc(config, Workload(n, **work)) for n in doc_tokens}}


def merge_into(path: Path, result: dict[str, Any]) -> dict[str, Any]:
    """Keep other document sizes already in ``path`` (one run per size fits the lock)."""
    if path.exists():
        old = json.loads(path.read_text())
        result["docs"] = {**old.get("docs", {}), **result["docs"]}
    return result


def plot_offload(result: dict[str, Any], path: str | Path) -> None:
    """Turn-2+ P50 TTFT per mode and document size, and restart vs warm (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    docs = sorted(result["docs"], key=int)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    labels = [*MODES, "disk after restart", "warm pool"]
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = []
        for doc in docs:
            d = result["docs"][doc]
            if label in MODES:
                values.append(d["modes"][label]["turn2_p50_ttft_s"])
            else:
                key = "restart_p50_ttft_s" if label.startswith("disk") else "warm_p50_ttft_s"
                values.append(d["restart"][key])
        xs = [j + (i - (len(labels) - 1) / 2) * width for j in range(len(docs))]
        bars = ax.bar(xs, values, width, label=label)
        ax.bar_label(bars, [f"{v:.2f}s" for v in values], fontsize=7)
    ax.set_yscale("log")
    ax.set_xticks(range(len(docs)), [f"{d}-token document" for d in docs])
    ax.set_ylabel("P50 time to first token, turns 2+ (s, log)")
    ax.set_title(f"KV offload tier: {result['kv_dtype']} KV, sessions 4x the pool")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_offload_cli(bench: Any) -> None:
    from slimkv.cli import add_config_args

    p = bench.add_parser("offload", help="multi-turn long documents, more sessions than the "
                         "pool holds: offload tier off / host / disk, and restart recovery")
    add_config_args(p)
    p.add_argument("--doc-tokens", default="2048,4096", help="document sizes, comma-separated")
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--sessions", type=int, default=4)
    p.add_argument("--out", default="bench/offload/offload.json", help="JSON (merged by size)")
    p.add_argument("--plot", default="bench/offload/offload.png", help="PNG to write")
    p.set_defaults(func=cmd_bench_offload)


def cmd_bench_offload(args: Any) -> int:
    from slimkv.cli import config_from_args

    docs = [int(x) for x in args.doc_tokens.split(",") if x]
    result = bench_offload(config_from_args(args), docs, turns=args.turns,
                           sessions=args.sessions)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result = merge_into(out, result)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot_offload(result, args.plot)
    for doc, d in sorted(result["docs"].items(), key=lambda kv: int(kv[0])):
        row = "  ".join(f"{m}={d['modes'][m]['turn2_p50_ttft_s']:.3f}s" for m in MODES)
        r = d["restart"]
        print(f"{doc} tokens: turn2+ P50 TTFT {row}; restart {r['restart_p50_ttft_s']:.3f}s "
              f"warm {r['warm_p50_ttft_s']:.3f}s")
    return 0
