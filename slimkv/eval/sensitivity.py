"""Per-layer KV sensitivity and a mixed-precision proposal (``slimkv eval --sensitivity``).

Each layer in turn stores its KV in the low-precision dtype while every other layer keeps
the reference dtype; the perplexity change against the all-reference run is what
quantizing that layer alone costs. The most sensitive layers then get the high-precision
dtype, greedily, as long as the average bits per KV value (the codecs' exact bytes: scales
and zero points included, staging apart) stays within the target. The proposal is validated
against uniform low and high precision and against a control mix of the same bytes whose
high-precision layers are the *least* sensitive ones.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from tqdm import tqdm

from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.eval import corpus
from slimkv.eval.harness import eval_config
from slimkv.eval.perplexity import TokenStats, next_token_logprobs
from slimkv.kv.cache import PagedKVCache
from slimkv.plugins import build_engine

RANK_METRICS = ("perplexity", "kl")


@dataclass(frozen=True, slots=True)
class KVShape:
    """What the bits per KV value depend on: the model's KV shape and the cache's scales."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    k_scale: str
    block_size: int

    @classmethod
    def of(cls, engine: LLMEngine) -> KVShape:
        args, kv = engine.model_args, engine.config.kv_cache
        return cls(args.num_layers, args.num_kv_heads, args.head_dim, kv.k_scale,
                   kv.block_size)

    def bits(self, dtype: str, layer_dtypes: dict[str, list[int]] | None = None) -> float:
        """Average stored bits per K or V element with ``dtype`` outside ``layer_dtypes``."""
        per_token = PagedKVCache.bytes_per_token(
            num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            k_dtype=dtype, v_dtype=dtype, k_scale=self.k_scale, block_size=self.block_size,
            layer_dtypes=layer_dtypes)
        return 8 * per_token / (2 * self.num_layers * self.num_kv_heads * self.head_dim)


@dataclass(frozen=True, slots=True)
class Score:
    """One configuration against the reference: perplexity change in percent, mean KL
    (nats per token), top-1 agreement in percent."""

    perplexity_change: float
    kl: float
    top1: float

    @classmethod
    def of(cls, stats: TokenStats, reference: TokenStats) -> Score:
        return cls(100 * (stats.perplexity / reference.perplexity - 1), stats.mean_kl,
                   100 * stats.top1_agreement)

    def sensitivity(self, metric: str) -> float:
        return self.perplexity_change if metric == "perplexity" else self.kl


@dataclass(frozen=True, slots=True)
class Candidate:
    """A KV layout evaluated in validation."""

    name: str
    dtype: str
    layer_dtypes: dict[str, list[int]] | None
    bits: float
    score: Score


@dataclass(slots=True)
class SensitivityRun:
    model: str
    reference: str
    low: str
    high: str
    target_bits: float
    rank_by: str
    tokens: int
    layers: list[Score]                      # index = layer
    ranking: list[int]                       # most sensitive first
    proposal: dict[str, list[int]]           # kv_cache.layer_dtypes on top of dtype=low
    validation: list[Candidate]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["layers"] = [{"layer": i, **asdict(s)} for i, s in enumerate(self.layers)]
        return out


class Scorer:
    """Scores corpus windows through engines built from one base config, against the
    reference dtype's next-token distributions (computed once, held in memory)."""

    def __init__(self, config: Config, reference: str, window: int,
                 num_windows: int | None) -> None:
        self.base = eval_config(config, reference, window)
        engine = build_engine(self.base)
        self.shape = KVShape.of(engine)
        self.model = engine.model_name
        self.windows = corpus.windows(engine.tokenizer, window, num_windows)
        self.targets = [torch.tensor(w[1:]) for w in self.windows]
        self.refs = [next_token_logprobs(engine.score(w)) for w in self.windows]
        self.reference = TokenStats()
        for ref, targets in zip(self.refs, self.targets):
            self.reference.add(ref, targets, ref)

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.targets)

    def score(self, dtype: str, layer_dtypes: dict[str, list[int]] | None) -> Score:
        engine = build_engine(self.base.replace("kv_cache", dtype=dtype, layer_dtypes=layer_dtypes))
        stats = TokenStats()
        for window, ref, targets in zip(self.windows, self.refs, self.targets):
            stats.add(next_token_logprobs(engine.score(window)), targets, ref)
        return Score.of(stats, self.reference)


def rank(scores: list[Score], metric: str) -> list[int]:
    """Layer indices, most sensitive first."""
    return sorted(range(len(scores)), key=lambda i: -scores[i].sensitivity(metric))


def propose(ranking: list[int], shape: KVShape, low: str, high: str,
            target_bits: float) -> dict[str, list[int]]:
    """``layer_dtypes`` giving ``high`` to the most sensitive layers of ``ranking`` that fit
    in ``target_bits`` per value, every other layer ``low``."""
    floor = shape.bits(low)
    if floor > target_bits:
        raise ValueError(f"target of {target_bits} bits per KV value is below {low} everywhere "
                         f"({floor:.3f} bits with these scales)")
    chosen: list[int] = []
    for layer in ranking:
        trial = sorted([*chosen, layer])
        if shape.bits(low, {high: trial}) <= target_bits:
            chosen = trial
    return {high: chosen} if chosen else {}


def run_sensitivity(config: Config, *, low: str = "int4", high: str = "int8",
                    reference: str = "float32", target_bits: float = 6.0,
                    rank_by: str = "perplexity", window: int = 1024,
                    num_windows: int | None = 2, progress: bool = True) -> SensitivityRun:
    """Measure every layer, propose a map for ``target_bits`` and validate it."""
    scorer = Scorer(config, reference, window, num_windows)
    layers = [scorer.score(reference, {low: [layer]})
              for layer in tqdm(range(scorer.shape.num_layers), desc=f"layers ({low} KV)",
                                disable=not progress)]
    ranking = rank(layers, rank_by)
    proposal = propose(ranking, scorer.shape, low, high, target_bits)
    count = len(proposal.get(high, []))
    control = {high: sorted(ranking[len(ranking) - count:])} if count else {}
    candidates = [("proposal", low, proposal), ("control: least sensitive", low, control),
                  (f"uniform {low}", low, None), (f"uniform {high}", high, None)]
    validation = [Candidate(name, dtype, mix or None, scorer.shape.bits(dtype, mix),
                            scorer.score(dtype, mix or None))
                  for name, dtype, mix in tqdm(candidates, desc="validation",
                                               disable=not progress)]
    return SensitivityRun(scorer.model, reference, low, high, target_bits, rank_by,
                          scorer.tokens, layers, ranking, proposal, validation)


def yaml_snippet(run: SensitivityRun) -> str:
    """The proposal as ``kv_cache`` keys."""
    lines = ["kv_cache:", f"  dtype: {run.low}"]
    lines += [f"  layer_dtypes: {{{dtype}: [{', '.join(map(str, layers))}]}}"
              for dtype, layers in run.proposal.items()]
    return "\n".join(lines)


def text_report(run: SensitivityRun) -> str:
    lines = [f"{run.model}: each layer alone in {run.low} KV, the rest {run.reference}; "
             f"{run.tokens} scored tokens; ranked by {run.rank_by}",
             f"{'rank':>4} {'layer':>5} {'ppl change %':>13} {'KL nats':>10} {'top-1 %':>8}"]
    for position, layer in enumerate(run.ranking, 1):
        s = run.layers[layer]
        lines.append(f"{position:>4} {layer:>5} {s.perplexity_change:>+13.3f} {s.kl:>10.6f} "
                     f"{s.top1:>8.2f}")
    lines += ["", f"proposal for {run.target_bits} bits per KV value:", yaml_snippet(run), "",
              f"{'validation':<26} {'bits':>6} {'ppl change %':>13} {'KL nats':>10} "
              f"{'top-1 %':>8}"]
    for c in run.validation:
        lines.append(f"{c.name:<26} {c.bits:>6.3f} {c.score.perplexity_change:>+13.3f} "
                     f"{c.score.kl:>10.6f} {c.score.top1:>8.2f}")
    return "\n".join(lines)
