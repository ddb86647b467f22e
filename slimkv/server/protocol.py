"""OpenAI-shaped request bodies (pydantic). Unknown request fields are ignored, as OpenAI's
own API does, so clients that send newer options keep working; fields of OpenAI's or vLLM's
schemas that slimkv does not implement are refused first (:mod:`slimkv.server.unsupported`),
tool calling's fields checked by :mod:`slimkv.server.tools`.

Options beyond the basics: OpenAI's penalties, ``logit_bias``, ``n``, ``logprobs`` (+ chat
``top_logprobs``), ``response_format``, completions' ``echo`` and lists of prompts; vLLM's
``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``prompt_logprobs``, ``add_special_tokens`` and the chat-template
controls. Out-of-range log-probability counts, invalid JSON schemas and contradictory
options are 400s (:meth:`SamplingRequest.check`, as vLLM and OpenAI answer them); other
field errors are 422s naming the field."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from slimkv.options.structured import JSON_OBJECT_SCHEMA, canonical_schema, schema_error
from slimkv.engine.sampling import SamplingParams
from slimkv.server.errors import APIError
from slimkv.server.tools import AssistantToolCall, ToolFields

MAX_LOGIT_BIAS = 1024
MAX_CHAT_LOGPROBS = 20      # OpenAI's limits
MAX_COMPLETION_LOGPROBS = 5
MAX_PROMPT_LOGPROBS = 20    # vLLM's default max_logprobs
# Not for chat_template_kwargs: apply_chat_template's parameters, the template's fixed inputs.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "self", "messages", "conversation", "tools", "documents", "chat_template",
    "add_generation_prompt", "continue_final_message", "tokenize", "sanitize_control_tokens",
    "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


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
    stop: str | list[str] | None = Field(default=None, validate_default=True)  # no cap (vLLM)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None  # vLLM extension
    skip_special_tokens: bool = True  # vLLM extension: False keeps e.g. <|im_start|> in text
    prompt_logprobs: int | None = Field(default=None, json_schema_extra={
        "minimum": 0, "maximum": MAX_PROMPT_LOGPROBS}, description="vLLM extension: the "
        "log-probability of each prompt token (the first: null) with this many alternatives")
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
        if not all(stops):
            raise ValueError("stop strings must not be empty")
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
        _check_range("prompt_logprobs", self.prompt_logprobs, MAX_PROMPT_LOGPROBS)
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs: not available when stream is true (as in "
                           "vLLM)", "invalid_value", "prompt_logprobs")

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = self.requested_max_tokens
        # echo with max_tokens 0 scores the prompt only: one token is generated, not shown.
        max_tokens = default_max_tokens if max_tokens is None else max(max_tokens, 1)
        return SamplingParams(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k, seed=self.seed, stop=self.stop, ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids or [], skip_special_tokens=self.skip_special_tokens,
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
    def echo_only(self) -> bool:
        """Only the prompt is returned (completions' ``echo`` with ``max_tokens: 0``)."""
        return False

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Alternatives per prompt token to compute, or None: no prompt logprobs."""
        return self.prompt_logprobs

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


class TemplateControls(BaseModel):
    """vLLM's chat-template controls: end with the assistant's header (the default), or
    continue the last (assistant) message as it stands; extra template variables."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise APIError(400, "continue_final_message: cannot be true together with "
                           "add_generation_prompt (set it to false)", "invalid_value",
                           "continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError(400, "continue_final_message: the last message must be the "
                           "assistant's", "invalid_value", "continue_final_message")
        if reserved := sorted(RESERVED_TEMPLATE_KWARGS & set(self.chat_template_kwargs or {})):
            raise APIError(400, f"chat_template_kwargs: {reserved} cannot be set here",
                           "invalid_value", "chat_template_kwargs")

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.as_template_message() for m in self.messages]

    def template_options(self) -> dict[str, Any]:
        """What the chat template is applied with (``Tokenizer.apply_chat_template``)."""
        return {**(self.chat_template_kwargs or {}),
                "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}


class ChatCompletionRequest(ToolFields, TemplateControls, SamplingRequest):
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, json_schema_extra={
        "minimum": 0, "maximum": MAX_CHAT_LOGPROBS})

    def check(self, max_n: int) -> None:
        super().check(max_n)
        _check_range("top_logprobs", self.top_logprobs, MAX_CHAT_LOGPROBS)
        self.check_template()

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Tokens = list[Annotated[int, Field(ge=0)]]


class CompletionRequest(SamplingRequest):
    """``prompt``: a text, token ids, or a list of either (one choice per prompt and ``n``,
    prompt ``i``'s choices at indices ``i * n`` to ``i * n + n - 1``)."""

    prompt: (Annotated[str, Field(min_length=1)] | Annotated[Tokens, Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
             | Annotated[list[Annotated[Tokens, Field(min_length=1)]], Field(min_length=1)])
    max_tokens: int | None = Field(default=16, ge=0, description="OpenAI's default, 16; 0 "
                                   "only with echo (the prompt's logprobs, nothing generated)")
    logprobs: int | None = Field(default=None, json_schema_extra={
        "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS})
    echo: bool = Field(default=False, description="return the prompt before the completion "
                       "(with logprobs: its tokens' log-probabilities, the first null)")
    add_special_tokens: bool = True  # vLLM extension: the tokenizer's BOS/EOS on text prompts

    def check(self, max_n: int) -> None:
        super().check(max_n)
        _check_range("logprobs", self.logprobs, MAX_COMPLETION_LOGPROBS)
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 is only allowed with echo (scoring a prompt)",
                           "invalid_value", "max_tokens")

    @property
    def prompts(self) -> list[str | list[int]]:
        one = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return [self.prompt] if one else list(self.prompt)

    @property
    def echo_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    @property
    def prompt_logprobs_k(self) -> int | None:
        """Alternatives per prompt token to compute: echo with logprobs asks for as many
        as the completion's (vLLM), prompt_logprobs for its own count."""
        asks = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                if k is not None]
        return max(asks) if asks else None

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


def model_card(model_name: str, max_model_len: int) -> dict[str, Any]:
    return {"id": model_name, "object": "model", "created": 0, "owned_by": "slimkv",
            "max_model_len": max_model_len}
