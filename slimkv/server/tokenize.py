"""vLLM's tokenizer routes: ``POST /tokenize`` (a text, or a chat through the model's
template), ``POST /detokenize`` and ``GET /tokenizer_info``, in vLLM's shapes. Clients
count tokens with them and lm-evaluation-harness's ``tokenizer_backend=remote`` uses them
instead of a local copy of the tokenizer. The tokenizer runs where the backend keeps it
(the engine thread, or the cluster ingress's own copy)."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel, Field

from slimkv.server.backend import Backend
from slimkv.server.body import read_body, read_json, validate
from slimkv.server.config import ServerConfig
from slimkv.server.errors import APIError
from slimkv.server.protocol import TemplateControls
from slimkv.server.schema import request_body


class TokenizeCompletionRequest(BaseModel):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(TemplateControls):
    model: str | None = None
    add_special_tokens: bool = Field(default=False, description="true is refused: the "
                                     "template places the special tokens")
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] = Field(json_schema_extra={"items": {"type": "integer", "minimum": 0}})


class DetokenizeResponse(BaseModel):
    prompt: str


TOKENIZER_REQUESTS = [TokenizeCompletionRequest, TokenizeChatRequest, DetokenizeRequest]


def install_tokenizer_routes(app: FastAPI, engine: Backend, server: ServerConfig,
                             auth: Any) -> None:
    guard = [Depends(auth)]

    def check_model(model: str | None) -> None:
        if model is not None and model != engine.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves "
                           f"{engine.model_name!r}", "model_not_found", "model")

    @app.post("/tokenize", dependencies=guard, response_model=TokenizeResponse,
              **request_body("TokenizeCompletionRequest", "TokenizeChatRequest"))
    async def tokenize(request: Request) -> dict[str, Any]:
        data = await read_json(request, server.max_body_bytes)
        if "messages" in data:
            chat = validate(TokenizeChatRequest, data)
            chat.check_template()
            if chat.add_special_tokens:
                raise APIError(400, "add_special_tokens: not for chats (the template places "
                               "the special tokens)", "unsupported_parameter",
                               "add_special_tokens")
            check_model(chat.model)
            messages, options = chat.template_messages(), chat.template_options()
            ids = await engine.tokenizer_call(
                lambda tok: _chat_ids(tok, messages, options))
            want_strs = chat.return_token_strs
        else:
            text = validate(TokenizeCompletionRequest, data)
            check_model(text.model)
            ids = await engine.tokenizer_call(
                lambda tok: tok.encode(text.prompt, text.add_special_tokens))
            want_strs = text.return_token_strs
        strs = await engine.tokenizer_call(lambda tok: tok.hf.convert_ids_to_tokens(ids)
                                           ) if want_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": strs}

    @app.post("/detokenize", dependencies=guard, response_model=DetokenizeResponse,
              **request_body("DetokenizeRequest"))
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await read_body(request, DetokenizeRequest, server.max_body_bytes)
        check_model(body.model)
        vocab = await engine.tokenizer_call(lambda tok: tok.vocab_size)
        if any(not 0 <= t < vocab for t in body.tokens):
            raise APIError(400, f"tokens: token ids must be in [0, {vocab})", "invalid_value",
                           "tokens")
        return {"prompt": await engine.tokenizer_call(
            lambda tok: tok.decode(body.tokens, skip_special_tokens=False))}

    @app.get("/tokenizer_info", dependencies=guard)
    async def tokenizer_info() -> dict[str, Any]:
        return await engine.tokenizer_call(lambda tok: _info(tok, engine.max_model_len))


def _chat_ids(tokenizer: Any, messages: list[dict[str, Any]], options: dict[str, Any]
              ) -> list[int]:
    try:
        return tokenizer.apply_chat_template(messages, **options)
    except ValueError as exc:
        raise APIError(400, str(exc), "invalid_value", "messages") from exc


def _info(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """vLLM's ``/tokenizer_info``: the tokenizer's class, special tokens and template."""
    hf = tokenizer.hf
    return {"tokenizer_class": type(hf).__name__, "eos_token": hf.eos_token,
            "bos_token": hf.bos_token, "pad_token": hf.pad_token, "unk_token": hf.unk_token,
            "chat_template": hf.chat_template, "model_max_length": max_model_len}
