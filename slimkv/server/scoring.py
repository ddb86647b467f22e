"""A prompt as the response shows it back: its text and tokens for ``echo``, and the
log-probability of each of its tokens given those before it (``echo`` with ``logprobs``,
vLLM's ``prompt_logprobs``).

The log-probabilities come from :meth:`LLMEngine.score`, a teacher-forced pass over the
whole prompt through the same paged, quantized cache as serving. Generation cannot give
them: a prefix-cache hit skips the cached positions (their KV is reused, their logits are
never computed) and a prefill keeps only its last row's logits. ``score`` reads nothing
from the prefix cache and leaves nothing in it, so the answer is the same whether or not
the prompt was cached. The price is a second pass over the prompt, run on the engine
thread between two steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from slimkv.engine.llm_engine import LLMEngine
    from slimkv.model.protocol import Tokenizer


@dataclass(slots=True)
class TokenScore:
    """One prompt token's log-probability, its rank among the vocabulary (1: the most
    likely) and the ``k`` most likely tokens at its position, best first."""

    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass(slots=True)
class PromptInfo:
    token_ids: list[int]
    text: str                                   # what ``echo`` prepends
    scores: list[TokenScore | None] | None = None  # per token; the first has none
    texts: dict[int, str] = field(default_factory=dict)  # token id -> its own text

    def token_texts(self) -> list[str]:
        return [self.texts[t] for t in self.token_ids]


def describe_prompt(tokenizer: Tokenizer, ids: list[int], text: str | None,
                    scores: list[TokenScore | None] | None = None) -> PromptInfo:
    """``text``: the prompt as sent, or None for a token-id prompt (then decoded, special
    tokens kept: the echo shows what the model saw)."""
    if text is None:
        text = tokenizer.decode(ids, skip_special_tokens=False)
    wanted = set(ids) | {t for s in scores or [] if s for t, _ in s.top}
    order = sorted(wanted)
    return PromptInfo(ids, text, scores, dict(zip(order, tokenizer.token_texts(order))))


def score_prompt(engine: LLMEngine, ids: list[int], k: int) -> list[TokenScore | None]:
    """Each token's :class:`TokenScore` with ``k`` alternatives (None for the first token:
    nothing precedes it)."""
    raw = engine.score(ids).float().log_softmax(-1)[:-1]  # row i predicts token i + 1
    target = torch.tensor(ids[1:], dtype=torch.long, device=raw.device).unsqueeze(1)
    chosen = raw.gather(1, target)
    ranks = (raw > chosen).sum(1).add(1).tolist()
    values, top_ids = raw.topk(k, dim=-1) if k else (raw[:, :0], raw[:, :0].long())
    return [None] + [TokenScore(lp, rank, list(zip(t, v))) for lp, rank, t, v in zip(
        chosen[:, 0].tolist(), ranks, top_ids.tolist(), values.tolist())]
