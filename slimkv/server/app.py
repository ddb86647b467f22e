"""The FastAPI app: OpenAI-shaped routes over an :class:`AsyncEngine`.

Bodies are read and parsed by :mod:`slimkv.server.body` rather than by FastAPI, so that an
oversized body, bytes that are not UTF-8, malformed or hostile JSON each get their own
OpenAI-style error (413/400) before the schema is checked (422); :mod:`slimkv.server.schema`
still describes the request and response models in ``/openapi.json``.
"""

from __future__ import annotations

import secrets
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request, Response

from slimkv.config import Config
from slimkv.engine.sampling_params import SamplingParams
from slimkv.options.tool_formats import GENERIC
from slimkv.plugins import build_engine
from slimkv.server.async_engine import AsyncEngine, GenerateRequest
from slimkv.server.backend import REPLICA_HEADER, Backend
from slimkv.server.canary import Canary
from slimkv.server.body import read_body
from slimkv.server.config import ServerConfig
from slimkv.server.dashboard import install_dashboard
from slimkv.server.errors import APIError, install_error_handlers
from slimkv.server.metrics import CONTENT_TYPE, ServerMetrics
from slimkv.server.protocol import (ChatCompletionRequest, CompletionRequest, SamplingRequest,
                                    model_card)
from slimkv.server.responses import (ChatFormat, CompletionFormat, ResponseFormat, merge_outputs,
                                     respond)
from slimkv.server.tool_responses import ToolChatFormat
from slimkv.server.tools import NO_TOOLS, ToolPlan, tool_plan
from slimkv.server.schema import Completion, ChatCompletion, generation_route, install_schema
from slimkv.server.tokenize import TOKENIZER_REQUESTS, install_tokenizer_routes
from slimkv.server.unsupported import CHAT, COMPLETIONS, refuse_unsupported

DEFAULT_MAX_TOKENS = 512  # when a request sets none: this, or the room left in the context


def bearer_auth(api_key: str | None):
    """A dependency that demands ``Authorization: Bearer <api_key>`` when a key is set."""
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), api_key):
            raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)",
                           "invalid_api_key")
    return check


def create_app(engine: Backend, server: ServerConfig) -> FastAPI:
    """The app starts the backend (one engine's thread, or a cluster's client) on startup
    and stops it on shutdown."""
    model_name = engine.model_name
    max_model_len = engine.max_model_len
    tool_format = getattr(engine, "tool_format", GENERIC)  # test doubles may have none

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        engine.stop()

    app = FastAPI(title="slimkv", lifespan=lifespan)
    app.state.model_name = model_name
    app.state.backend = engine   # what `slimkv serve` drains on SIGTERM
    install_error_handlers(app)
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(bearer_auth(server.api_key))])

    async def generate(body: SamplingRequest, prompts: list[Any], fmt: ResponseFormat,
                       http: Request, tools: ToolPlan = NO_TOOLS, **options: Any) -> Response:
        """One engine request per prompt (``options``: GenerateRequest's fields)."""
        if body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves "
                           f"{model_name!r}", "model_not_found", "model")
        body.check(server.max_n)
        fmt.n, fmt.prompt_logprobs, fmt.echo_only = body.n, body.prompt_logprobs, body.echo_only
        session_id = body.session_id or http.headers.get("x-session-id") or None

        def make_params(num_prompt_tokens: int) -> SamplingParams:
            params = body.sampling_params(
                max(1, min(DEFAULT_MAX_TOKENS, max_model_len - num_prompt_tokens)))
            params.grammar = tools.grammar
            return params

        fmt.requests = [GenerateRequest(
            fmt.request_id if len(prompts) == 1 else f"{fmt.request_id}-{p}", prompt,
            isinstance(body, ChatCompletionRequest), make_params, session_id=session_id,
            prompt_logprobs=body.prompt_logprobs_k, tools=tools.template_tools, **options)
            for p, prompt in enumerate(prompts)]
        streams = [engine.generate(r) for r in fmt.requests]
        outputs = streams[0] if len(streams) == 1 else merge_outputs(
            streams, body.n, stagger=getattr(engine, "routes_one_call_at_a_time", False))
        response = await respond(outputs, body, fmt, http, body.n * len(prompts))
        if replicas := sorted({r.replica for r in fmt.requests if r.replica is not None}):
            response.headers[REPLICA_HEADER] = ",".join(replicas)
        return response

    @v1.post("/chat/completions", **generation_route(ChatCompletionRequest, ChatCompletion))
    async def chat_completions(request: Request) -> Response:
        body = await read_body(request, ChatCompletionRequest, server.max_body_bytes,
                               lambda data: refuse_unsupported(data, CHAT))
        tools = tool_plan(body, tool_format, body.response_format is not None
                          and body.response_format.type != "text")
        fmt = (ToolChatFormat(_new_id("chatcmpl"), model_name, tool_format=tool_format)
               if tools.grammar
               else ChatFormat(_new_id("chatcmpl"), model_name))
        return await generate(body, [body.template_messages()], fmt, request, tools,
                              template=body.template_options())

    @v1.post("/completions", **generation_route(CompletionRequest, Completion))
    async def completions(request: Request) -> Response:
        body = await read_body(request, CompletionRequest, server.max_body_bytes,
                               lambda data: refuse_unsupported(data, COMPLETIONS))
        fmt = CompletionFormat(_new_id("cmpl"), model_name, echo=body.echo,
                               echo_k=body.logprobs or 0)
        return await generate(body, body.prompts, fmt, request, echo=body.echo,
                              add_special_tokens=body.add_special_tokens)

    @v1.get("/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(model_name, max_model_len)]}

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await engine.exposition(), media_type=CONTENT_TYPE)

    install_dashboard(app, v1, engine, server.api_key)
    install_tokenizer_routes(app, engine, server, bearer_auth(server.api_key))
    app.include_router(v1)
    install_schema(app, [ChatCompletionRequest, CompletionRequest, *TOKENIZER_REQUESTS])
    return app


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def build_app(config: Config) -> FastAPI:
    """Load the engine for ``config`` and wrap it in the app (the engine thread starts with it)."""
    llm_engine = build_engine(config)
    metrics = ServerMetrics(llm_engine.model_name)
    canary = (Canary(config, metrics.registry, llm_engine.model_name)
              if config.canary.fraction > 0 else None)
    return create_app(AsyncEngine(llm_engine, metrics, canary=canary), config.server)
