"""Log-probabilities of sampled tokens (OpenAI's ``logprobs``): taken from the model's raw
logits, before penalties, bias, grammar masks and temperature (vLLM's default "raw"
logprobs), with the top alternatives a request asked for. First in the processors' list,
so that it sees the logits before the others edit them."""

from __future__ import annotations

import torch

from slimkv.engine.sampling import LogitsProcessor, SampledToken
from slimkv.engine.sequence import Sequence


class Logprobs(LogitsProcessor):
    options = frozenset({"logprobs"})

    def __init__(self) -> None:
        self._raw: torch.Tensor | None = None  # this step's log-softmax of the raw logits

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        self._raw = logits.log_softmax(-1)

    def accept(self, seqs: list[Sequence], sampled: list[SampledToken]) -> None:
        with_logprobs(sampled, self._raw, [s.params.logprobs for s in seqs])
        self._raw = None


def with_logprobs(sampled: list[SampledToken], raw: torch.Tensor,
                  asks: list[int | None]) -> None:
    """Set the logprob and the top ``asks[row]`` alternatives of each row that asks."""
    tokens = [s.token_id for s in sampled]
    chosen = raw.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1))[:, 0].tolist()
    k = max(a for a in asks if a is not None)
    top_values, top_ids = (raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    for row, (token, ask) in enumerate(zip(sampled, asks)):
        if ask is not None:
            token.logprob = chosen[row]
            token.top = list(zip(top_ids[row][:ask], top_values[row][:ask]))
