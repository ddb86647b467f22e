"""Log-probabilities of sampled tokens (OpenAI's ``logprobs``): taken from the model's raw
logits, before penalties, bias, grammar masks and temperature (vLLM's default "raw"
logprobs), with the top alternatives a request asked for."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SampledToken:
    """A sampled token; with logprobs when its request asked: its own and the top ones."""

    token_id: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class TokenLogprob:
    """A generated token's text, log-probability and the top alternatives, best first."""

    token: str
    logprob: float
    top: list[tuple[str, float]]


def with_logprobs(tokens: list[int], raw: torch.Tensor | None,
                  asks: list[int | None]) -> list[SampledToken]:
    """``raw``: log-softmax of the raw logits (None when no row asked)."""
    if raw is None:
        return [SampledToken(t) for t in tokens]
    chosen = raw.gather(1, torch.tensor(tokens, device=raw.device).unsqueeze(1))[:, 0].tolist()
    k = max(a for a in asks if a is not None)
    top_values, top_ids = (raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [SampledToken(t) if ask is None else
            SampledToken(t, chosen[row], list(zip(top_ids[row][:ask], top_values[row][:ask])))
            for row, (t, ask) in enumerate(zip(tokens, asks))]


def token_logprobs(tokenizer, sampled: SampledToken) -> list[TokenLogprob] | None:
    """The sampled token's logprobs with token texts, as a ``RequestOutput`` carries them."""
    if sampled.logprob is None:
        return None
    texts = tokenizer.token_texts([sampled.token_id, *(t for t, _ in sampled.top)])
    return [TokenLogprob(texts[0], sampled.logprob,
                         [(text, lp) for text, (_, lp) in zip(texts[1:], sampled.top)])]
