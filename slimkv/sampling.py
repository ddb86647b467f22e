"""The batched sampler (per-request parameters: :mod:`slimkv.sampling_params`).

Per step: raw logprobs (:mod:`slimkv.logprobs`), the batched logit processors
(:mod:`slimkv.logits_process`), grammar masks (:mod:`slimkv.structured`), then the draw.
"""

from __future__ import annotations

import torch

from slimkv.logits_process import process_logits_
from slimkv.logprobs import SampledToken, with_logprobs
from slimkv.sampling_params import SamplingParams
from slimkv.sequence import Sequence
from slimkv.structured import Grammars

__all__ = ["Sampler", "SamplingParams", "SampledToken"]


class Sampler:
    """Samples one token per row; rows may carry different parameters."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset(),
                 grammars: Grammars | None = None) -> None:
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        if all(s.params.greedy and s.params.plain and s.params.logprobs is None for s in seqs):
            return [SampledToken(t) for t in logits.argmax(dim=-1).tolist()]  # nothing to do
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
        return with_logprobs(tokens, raw, asks)


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
