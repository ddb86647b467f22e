"""OpenAI-shaped request bodies (pydantic) and the response payloads built from engine
outputs. Unknown request fields are ignored, as OpenAI's own API does, so clients that
send newer options keep working; fields we cannot honour (``n > 1``) are rejected."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from slimkv.outputs import RequestOutput
from slimkv.sampling import SamplingParams

MAX_STOP_STRINGS = 4


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch takes
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens
    # slimkv extension (or the X-Session-ID header): the conversation this turn belongs to;
    # the head of a live session's context is the last KV the pool evicts.
    session_id: str | None = Field(default=None, min_length=1, max_length=256)

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> list[str]:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP_STRINGS or not all(stops):
            raise ValueError(f"at most {MAX_STOP_STRINGS} non-empty stop strings")
        return stops

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=self.requested_max_tokens or default_max_tokens,
                              temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart]

    def as_template_message(self) -> dict[str, str]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions


def usage(out: RequestOutput) -> dict[str, Any]:
    """OpenAI's usage block; ``cached_tokens`` are prompt tokens served by the prefix cache."""
    return {"prompt_tokens": out.num_prompt_tokens, "completion_tokens": out.num_output_tokens,
            "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens}}


def response_envelope(request_id: str, obj: str, model: str, choices: list[dict[str, Any]],
                      usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": obj, "created": int(time.time()),
                            "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_choice(text: str | None, finish_reason: str | None, *, delta: bool,
                first: bool = False) -> dict[str, Any]:
    """One chat choice: a full ``message`` or a streaming ``delta``."""
    if not delta:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason, "logprobs": None}
    content: dict[str, str] = {"role": "assistant"} if first else {}
    if text:
        content["content"] = text
    return {"index": 0, "delta": content, "finish_reason": finish_reason, "logprobs": None}


def completion_choice(text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}


def model_card(model_name: str, max_model_len: int) -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "slimkv",
            "max_model_len": max_model_len}
