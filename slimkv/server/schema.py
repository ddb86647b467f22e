"""What ``/openapi.json`` says about the API: the response models (documentation only;
responses are built as dicts in :mod:`slimkv.server.protocol`) and the request bodies.

The routes read and check their bodies themselves (:mod:`slimkv.server.body`: size limit,
parser hardening, the error shapes), so FastAPI sees no body parameter; the request models
are added to the schema's components here and referenced from each route's
``openapi_extra``.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from slimkv.server.tools import AssistantToolCall


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[AssistantToolCall] | None = None  # with tools (finish_reason tool_calls)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = None  # only when the request asked


class CompletionLogprobs(BaseModel):
    """With ``echo``, the prompt's tokens come first; its first token's entries are null."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class PromptLogprob(BaseModel):
    """vLLM's: one token's log-probability, rank in the vocabulary (1: most likely), text."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt token (null for the first): token id (a string key) -> its PromptLogprob.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None
    prompt_logprobs: PromptLogprobs | None = None  # only when the request asked


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


_ERRORS = {status: {"model": ErrorResponse, "description": what} for status, what in {
    400: "unreadable body or a request the engine cannot serve", 401: "missing or wrong API key",
    404: "unknown model", 413: "body over server.max_body_bytes",
    422: "a field fails the schema", 429: "server busy (Retry-After)"}.items()}


def generation_route(request_model: type[BaseModel], response_model: type[BaseModel]
                     ) -> dict[str, Any]:
    """The keyword arguments that describe a generation route to FastAPI."""
    ok = {"model": response_model, "description": "the completion, or server-sent events "
          "(`data: {chunk}` lines, then `data: [DONE]`) when `stream` is true",
          "content": {"text/event-stream": {"schema": {"type": "string"}}}}
    return {"responses": {200: ok, **_ERRORS}, **request_body(request_model.__name__)}


def request_body(*names: str) -> dict[str, Any]:
    """``openapi_extra`` naming a route's body: one of these component schemas."""
    refs = [{"$ref": f"#/components/schemas/{name}"} for name in names]
    schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
    return {"openapi_extra": {"requestBody": {"required": True, "content": {
        "application/json": {"schema": schema}}}}}


def install_schema(app: FastAPI, request_models: list[type[BaseModel]]) -> None:
    """Add ``request_models`` (as the server validates them) to the OpenAPI components."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                                 description=app.description)
            _, defs = models_json_schema([(m, "validation") for m in request_models],
                                         ref_template="#/components/schemas/{model}")
            schema.setdefault("components", {}).setdefault("schemas", {}).update(
                defs.get("$defs", {}))
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
