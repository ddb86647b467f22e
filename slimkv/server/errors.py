"""OpenAI-style errors: every failure the API reports has the body
``{"error": {"message", "type", "param", "code"}}`` and a 4xx status, never a bare 500.

Status codes: 400 the body cannot be read (malformed JSON, not UTF-8) or the engine
cannot serve the request as asked (prompt longer than the context window, absurd
``max_tokens``); 401 missing or wrong API key; 404 unknown model or route; 413 body
over ``server.max_body_bytes``; 422 well-formed JSON that fails the schema (missing or
invalid fields, empty messages, negative ``max_tokens``); 429 server busy (queue full or
queue timeout), with ``Retry-After``.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          422: "invalid_request_error", 429: "server_busy", 500: "internal_error"}


class APIError(Exception):
    """An error to report to the client with an HTTP status."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class ServerBusy(APIError):
    """The queue is full or a request waited past ``scheduler.queue_timeout_s``."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(429, message, "server_busy",
                         headers={"Retry-After": str(retry_after_s)})


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """422 naming the first offending field, e.g. ``messages: List should have at least 1 item``."""
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = f"{param}: {first['msg']}" if param else first["msg"]
    return APIError(422, message, "invalid_value", param)


def install_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = "not_found" if exc.status_code == 404 else "http_error"
        return APIError(exc.status_code, str(exc.detail), code).response()

    async def request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, request_validation)
    app.add_middleware(CatchAll)


class CatchAll:
    """Answers a bug with a 500 in the error shape *and swallows the exception*.

    Starlette's own last-resort handler re-raises after answering, and uvicorn then closes
    the connection: one bad request would cost the client its keep-alive connection. Here
    the exception ends at this middleware (logged); if the response had already started
    there is nothing left to send, and the connection still stays open."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:
            log.exception("unhandled error: %s", exc)
            if not started:
                await APIError(500, "internal server error", "internal_error").response()(
                    scope, receive, send)
