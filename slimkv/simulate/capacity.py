"""The case's experiment at its own scale: a 7B model on one data-centre card, the
long-session workload swept over concurrency, per KV layout; then what our policies
(soft limit, lanes, watermark, head protection) change."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

from slimkv.simulate.card import VARIANTS, Card, Variant
from slimkv.simulate.costs import device
from slimkv.simulate.run import run_level
from slimkv.simulate.workload import SessionSpec

STORM_SHARE = 0.1     # as bench/REPORT.md: a level with more preemptions is not "served"
FLAT_FACTOR = 2.0     # P99 TTFT "flat": within 2x of the lowest level's


@dataclass(frozen=True, slots=True)
class CaseSpec:
    model: str = "llama-2-7b"
    device: str = "A100-80GB"
    context: int = 4096
    doc_tokens: int = 2048
    max_tokens: int = 256
    levels: tuple[int, ...] = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96)
    duration: float = 600.0
    warmup: float = 120.0
    soft: int = 48
    seed: int = 0

    @property
    def session(self) -> SessionSpec:
        return SessionSpec(self.context, self.doc_tokens, self.max_tokens, seed=self.seed)


def sessions_served(levels: list[dict[str, Any]]) -> int:
    return max((lv["peak_running"] for lv in levels
                if lv["preemptions"] <= STORM_SHARE * max(1, lv["requests_done"])), default=0)


def flat_up_to(levels: list[dict[str, Any]]) -> int | None:
    base, flat = levels[0]["ttft_s"]["p99"], None
    for lv in levels:
        p99 = lv["ttft_s"]["p99"]
        if base is None or p99 is None or p99 > FLAT_FACTOR * base:
            break
        flat = lv["concurrency"]
    return flat


def limited_by(card: Card, levels: list[dict[str, Any]], served: int) -> str:
    """What stopped admission at the top level: the soft limit, the KV watermark, the
    slow lane's block share (every case request is long), or the offered load."""
    top = levels[-1]
    if served >= card.kv.max_concurrency_soft:
        return "soft limit"
    if top["peak_kv_usage"] >= card.kv.watermark:
        return "KV memory (watermark)"
    if top["peak_waiting"] and card.sched.policy == "weighted":
        return "slow-lane block share"
    return "offered load" if not top["peak_waiting"] else "step token budget"


def sweep(card: Card, spec: CaseSpec) -> dict[str, Any]:
    levels = []
    for c in spec.levels:
        levels.append(run_level(card.engine(), spec.session, c, spec.duration,
                                spec.warmup).summary())
    served = sessions_served(levels)
    return {**card.facts(), "sessions_served": served, "limited_by": limited_by(card, levels, served),
            "p99_ttft_flat_up_to": flat_up_to(levels), "levels": levels}


POLICY_DTYPES = ("bfloat16", "int8", "int4")


def policy_cards(spec: CaseSpec, dev, dtypes: tuple[str, ...] = POLICY_DTYPES
                 ) -> list[tuple[str, Card]]:
    """Each of our admission policies taken away (or the soft limit lifted), one at a time."""
    out = []
    for v in (Variant(d) for d in dtypes):
        base = Card.build(spec.model, dev, v, spec.context, soft=spec.soft)
        lifted = Card.build(spec.model, dev, v, spec.context, soft=256)
        out += [(f"{v.name}: default", base),
                (f"{v.name}: soft limit 256", lifted),
                (f"{v.name}: soft 256, no lanes (fcfs)", lifted.with_sched(policy="fcfs")),
                (f"{v.name}: soft 256, fcfs, no watermark", lifted.with_sched(policy="fcfs")
                 .with_kv(watermark=1.0)),
                (f"{v.name}: soft 256, fifo eviction (no head protection)",
                 lifted.with_kv(evict_policy="fifo"))]
    return out


def run_case(spec: CaseSpec, variants: tuple[Variant, ...] = VARIANTS,
             policy_level: int = 128, progress: bool = True,
             policy_dtypes: tuple[str, ...] = POLICY_DTYPES) -> dict[str, Any]:
    dev = device(spec.device)
    start = time.monotonic()
    results = []
    for v in variants:
        card = Card.build(spec.model, dev, v, spec.context, soft=spec.soft)
        results.append(sweep(card, spec))
        if progress:
            print(f"  {spec.model} {spec.device} {v.name:>16}: {results[-1]['sessions_served']} "
                  f"sessions ({results[-1]['limited_by']})", flush=True)
    policies = []
    for label, card in policy_cards(spec, dev, policy_dtypes):
        lv = run_level(card.engine(), spec.session, policy_level, spec.duration,
                       spec.warmup).summary()
        policies.append({"policy": label, "concurrency": policy_level, **lv})
        if progress:
            print(f"  {label:>55}: running<={lv['peak_running']} preemptions="
                  f"{lv['preemptions']} p99 TTFT={lv['ttft_s']['p99']}", flush=True)
    return {"spec": asdict(spec), "variants": results, "policies": policies,
            "elapsed_s": round(time.monotonic() - start, 1)}


def merge_case(old: dict[str, Any] | None, new: dict[str, Any]) -> dict[str, Any]:
    """A case run in pieces (some variants, some policy rows each): ``new``'s results over
    ``old``'s when both ran the same spec; variants in :data:`VARIANTS` order."""
    piece = {"command": new.get("command"), "elapsed_s": new["elapsed_s"]}
    if old is None or old["spec"] != json.loads(json.dumps(new["spec"])):
        return {**new, "pieces": [piece]}
    order = [v.name for v in VARIANTS]
    variants = {v["variant"]: v for v in old["variants"]} | {v["variant"]: v for v in new["variants"]}
    policies = {p["policy"]: p for p in old["policies"]} | {p["policy"]: p for p in new["policies"]}
    pieces = old.get("pieces", [{"command": old.get("command"), "elapsed_s": old["elapsed_s"]}])
    pieces = pieces + [piece]
    return {**new, "variants": sorted(variants.values(), key=lambda v: order.index(v["variant"])
                                      if v["variant"] in order else len(order)),
            "policies": list(policies.values()), "pieces": pieces,
            "elapsed_s": round(sum(p["elapsed_s"] for p in pieces), 1)}
