"""Teacher-forced next-token statistics of one KV dtype against a reference, window by
window: perplexity, KL(reference || dtype) and top-1 agreement."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(slots=True)
class TokenStats:
    """Sums over every predicted position of every window seen so far."""

    tokens: int = 0
    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0

    def add(self, logprobs: Tensor, targets: Tensor, reference: Tensor) -> None:
        """``logprobs`` and ``reference`` are ``[n, vocab]`` log-softmaxes predicting
        ``targets [n]``."""
        self.tokens += len(targets)
        self.nll -= logprobs.gather(1, targets[:, None]).sum().item()
        self.kl += (reference.exp() * (reference - logprobs)).sum().item()
        self.agree += (logprobs.argmax(-1) == reference.argmax(-1)).sum().item()

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens)

    @property
    def mean_kl(self) -> float:
        """Mean KL divergence in nats per token."""
        return self.kl / self.tokens

    @property
    def top1_agreement(self) -> float:
        """Fraction of positions whose argmax matches the reference's."""
        return self.agree / self.tokens


def next_token_logprobs(logits: Tensor) -> Tensor:
    """Log-softmax of the logits at every position but the last (which predicts past the
    window), in float32."""
    return torch.log_softmax(logits[:-1].float(), dim=-1)
