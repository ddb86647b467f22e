"""OpenAI-shaped request bodies (pydantic). Unknown request fields are ignored, as OpenAI's
own API does, so clients that send newer options keep working.

Options beyond the basics: ``presence_penalty``, ``frequency_penalty``, ``logit_bias``,
``n``, ``logprobs`` (+ chat ``top_logprobs``), ``response_format``; and vLLM's
``repetition_penalty``, ``min_tokens``, ``ignore_eos``. Log-probability counts out of range
and invalid JSON schemas are 400s (checked by :meth:`SamplingRequest.check`, as vLLM and
OpenAI answer them); other field errors are 422s naming the field. Tool calling's fields
and their 400s: :mod:`slimkv.server.tools`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from slimkv.options.structured import JSON_OBJECT_SCHEMA, canonical_schema, schema_error
from slimkv.engine.sampling import SamplingParams
from slimkv.server.errors import APIError
from slimkv.server.tools import AssistantToolCall, ToolFields

MAX_STOP_STRINGS = 4
MAX_LOGIT_BIAS = 1024
MAX_CHAT_LOGPROBS = 20      # OpenAI's limits
MAX_COMPLETION_LOGPROBS = 5


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text`` (no constraint), ``json_object`` (any JSON object) or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def schema_json(self) -> str | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return canonical_schema(JSON_OBJECT_SCHEMA)
        if self.json_schema is None:
            raise APIError(400, "response_format: type json_schema needs a json_schema",
                           "invalid_value", "response_format")
        return canonical_schema(self.json_schema.schema_)


class SamplingRequest(BaseModel):
    """Fields shared by both endpoints."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)  # what torch takes
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    n: int = Field(default=1, ge=1, description="choices to generate (at most server.max_n); "
                   "they share the prompt's prefill through the prefix cache")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS)
    response_format: ResponseFormat | None = None
    ignore_eos: bool = False  # vLLM extension: generate exactly max_tokens
    repetition_penalty: float = Field(default=1.0, gt=0, le=100)  # vLLM extension
    min_tokens: int = Field(default=0, ge=0)  # vLLM extension: no stop before this many
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

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for token, value in (bias or {}).items():
            if not token.isdigit() or len(token) > 9 or not -100 <= value <= 100:
                raise ValueError("maps token ids (as strings) to biases in [-100, 100]")
        return bias

    def check(self, max_n: int) -> None:
        """The 400s: options the schema admits that this request cannot be served with."""
        if self.n > max_n:
            raise APIError(400, f"n: at most {max_n} choices (server.max_n)", "invalid_value",
                           "n")
        if self.response_format is not None:
            schema = self.response_format.schema_json()
            error = schema and schema_error(schema)
            if error:
                raise APIError(400, f"response_format: invalid JSON schema: {error}",
                               "invalid_value", "response_format")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.requested_max_tokens or default_max_tokens
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
            min_tokens=min(self.min_tokens, max_tokens), presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias={int(t): b for t, b in (self.logit_bias or {}).items()},
            logprobs=self.num_logprobs, n=self.n,
            json_schema=self.response_format.schema_json() if self.response_format else None)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """Top alternatives per token to return (0: the sampled token's only), or None."""
        return None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _check_range(name: str, value: int | None, most: int) -> None:
    if value is not None and not 0 <= value <= most:
        raise APIError(400, f"{name}: must be in [0, {most}], got {value}", "invalid_value", name)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn with tool_calls
    name: str | None = None
    tool_call_id: str | None = None  # a tool turn: the call it answers
    tool_calls: list[AssistantToolCall] | None = None

    @model_validator(mode="after")
    def _check_content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"content: a {self.role} message needs content (only an "
                             "assistant turn, with tool_calls, may have none)")
        return self

    def as_template_message(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": self.role, "content": content}
        return {**message, **self.model_dump(include={"name", "tool_call_id", "tool_calls"},
                                             exclude_none=True)}


class ChatCompletionRequest(ToolFields, SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, json_schema_extra={
        "minimum": 0, "maximum": MAX_CHAT_LOGPROBS})

    def check(self, max_n: int) -> None:
        super().check(max_n)
        _check_range("top_logprobs", self.top_logprobs, MAX_CHAT_LOGPROBS)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, json_schema_extra={
        "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS})

    def check(self, max_n: int) -> None:
        super().check(max_n)
        _check_range("logprobs", self.logprobs, MAX_COMPLETION_LOGPROBS)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


def model_card(model_name: str, max_model_len: int) -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "slimkv",
            "max_model_len": max_model_len}
