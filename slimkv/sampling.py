"""The batched sampler (per-request parameters: :mod:`slimkv.sampling_params`)."""

from __future__ import annotations

import torch

from slimkv.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplingParams"]


class Sampler:
    """Samples one token per row; rows may carry different parameters."""

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        tokens = logits.argmax(dim=-1).tolist()
        for row, (p, gen) in enumerate(zip(params, generators)):
            if not p.greedy:
                tokens[row] = self._sample_row(logits[row], p, gen)
        return tokens

    @staticmethod
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
