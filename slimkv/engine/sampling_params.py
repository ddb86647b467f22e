"""What to generate for one request (plain Python: the scheduler and the KV manager use
it without torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat limit)


@dataclass(slots=True)
class SamplingParams:
    """What to generate for one request. ``temperature == 0`` means greedy.

    ``logprobs``: return each sampled token's log-probability and this many top
    alternatives (0: the sampled token's only; None: none), computed from the model's raw
    logits (before penalties, bias, grammar and temperature). ``json_schema``: the output
    must be JSON matching this schema (a JSON string; ``{}`` or ``{"type": "object"}`` for
    plain JSON mode). ``grammar``: the output must match this llguidance Lark grammar (tool
    calling's, :mod:`slimkv.options.tool_calls`). ``skip_special_tokens``: leave special
    tokens out of the text. ``n`` outputs share the prompt's prefill through the prefix
    cache.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None
    skip_special_tokens: bool = True
    json_schema: str | None = None
    grammar: str | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                 "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(_number(self.temperature) and 0 <= self.temperature <= 100,
                 "temperature", f"must be in [0, 100], got {self.temperature!r}")
        _require(_number(self.top_p) and 0 < self.top_p <= 1,
                 "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0,
                 "top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _require(all(isinstance(s, str) and s for s in self.stop),
                 "stop", "must be non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids", "must be non-negative integers")
        _require(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
                 "min_tokens", f"must be an integer in [0, max_tokens], got {self.min_tokens!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _require(_number(value) and -2 <= value <= 2, name, f"must be in [-2, 2], got {value!r}")
        _require(_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 100,
                 "repetition_penalty", f"must be in (0, 100], got {self.repetition_penalty!r}")
        _require(all(isinstance(t, int) and t >= 0 and _number(b) and -100 <= b <= 100
                     for t, b in self.logit_bias.items()),
                 "logit_bias", "maps token ids (>= 0) to biases in [-100, 100]")
        _require(self.logprobs is None or (isinstance(self.logprobs, int)
                                           and 0 <= self.logprobs <= MAX_LOGPROBS),
                 "logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        _require(isinstance(self.n, int) and self.n >= 1, "n", f"must be >= 1, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def options(self) -> frozenset[str]:
        """The OpenAI options asked for, by the names of the logits processors that serve
        them (:class:`~slimkv.engine.sampling.LogitsProcessor`)."""
        asked = {"logprobs": self.logprobs is not None, "min_tokens": self.min_tokens,
                 "logit_bias": self.logit_bias, "penalties": self.has_penalties,
                 "json_schema": self.json_schema is not None,
                 "grammar": self.grammar is not None}
        return frozenset(name for name, on in asked.items() if on)

    @property
    def plain(self) -> bool:
        """No option that changes the logits before sampling (penalties, bias, min_tokens,
        a grammar): the served choice is the model's own."""
        return self.options <= {"logprobs"}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
