"""The batched sampler (per-request parameters: :mod:`slimkv.sampling_params`).

One call per step over the rows that sample: log-probabilities of the raw logits (for the
rows that asked: vLLM's default "raw" logprobs, before any processing), then the batched
logit processors (:mod:`slimkv.logits_process`), the grammar masks of rows with a
response format (:mod:`slimkv.structured`), and the draw (greedy, or temperature, top-k,
top-p).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slimkv.logits_process import process_logits_
from slimkv.sampling_params import SamplingParams
from slimkv.sequence import Sequence
from slimkv.structured import Grammars

__all__ = ["Sampler", "SamplingParams", "SampledToken"]


@dataclass(slots=True)
class SampledToken:
    """A sampled token; with logprobs when its request asked: its own and the top ones."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


class Sampler:
    """Samples one token per row; rows may carry different parameters."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset(),
                 grammars: Grammars | None = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        logits = logits.float().clone()  # processed in place below
        asks = [s.params.logprobs for s in seqs]
        raw = logits.log_softmax(-1) if any(k is not None for k in asks) else None
        process_logits_(logits, seqs, self.eos_token_ids)
        constrained = [(row, s.matcher) for row, s in enumerate(seqs) if s.matcher is not None]
        if constrained:
            self.grammars.mask_(logits, *map(list, zip(*constrained)))
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        if constrained:
            Grammars.advance([m for _, m in constrained], [tokens[row] for row, _ in constrained])
        return _with_logprobs(tokens, raw, asks)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[row] = _sample_row(logits[row], p, gen)
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    logits = logits.float() / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs > p.top_p  # keep the smallest set reaching top_p
        logits = logits.index_fill(0, order[drop], float("-inf"))
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=gen).item())


def _with_logprobs(tokens: list[int], raw: torch.Tensor | None,
                   asks: list[int | None]) -> list[SampledToken]:
    if raw is None:
        return [SampledToken(t) for t in tokens]
    chosen = raw.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1))[:, 0].tolist()
    k = max(a for a in asks if a is not None)
    top_values, top_ids = (raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [SampledToken(t) if ask is None else
            SampledToken(t, chosen[row], list(zip(top_ids[row][:ask], top_values[row][:ask])))
            for row, (t, ask) in enumerate(zip(tokens, asks))]
