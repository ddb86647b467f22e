"""What to generate for one request (plain Python: the scheduler and the KV manager use
it without torch)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """What to generate for one request. ``temperature == 0`` means greedy."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _require(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
                 "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        _require(isinstance(self.temperature, (int, float)) and 0 <= self.temperature <= 100,
                 "temperature", f"must be in [0, 100], got {self.temperature!r}")
        _require(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
                 "top_p", f"must be in (0, 1], got {self.top_p!r}")
        _require(isinstance(self.top_k, int) and self.top_k >= 0,
                 "top_k", f"must be an integer >= 0 (0 = off), got {self.top_k!r}")
        _require(all(isinstance(s, str) and s for s in self.stop),
                 "stop", "must be non-empty strings")
        _require(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                 "stop_token_ids", "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {message}")
