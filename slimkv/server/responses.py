"""Turning a request's stream of engine outputs into an HTTP response: one JSON body, or
server-sent events (``data: {chunk}`` lines ending with ``data: [DONE]``).

The first output is awaited before any byte is sent, so a request the engine rejects
(400) or that finds the server busy (429) gets a real error status even when streaming.
While no byte has been sent (queued, prefilling, or a whole non-streaming answer), the
client's connection is watched: if it goes away the request is aborted at once, so an
abandoned request neither keeps its place in the queue nor holds KV blocks.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Send

from slimkv.outputs import RequestOutput
from slimkv.server.errors import APIError
from slimkv.server.protocol import (SamplingRequest, chat_choice, completion_choice,
                                    response_envelope, usage)


@dataclass(slots=True)
class ResponseFormat:
    """Shapes outputs as one endpoint's objects; subclasses give the choice layout."""

    request_id: str
    model: str
    object_name = ""
    chunk_object_name = ""

    def choice(self, text: str, finish_reason: str | None, delta: bool, first: bool) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, out: RequestOutput, first: bool = False) -> dict[str, Any]:
        return response_envelope(self.request_id, self.chunk_object_name, self.model,
                                 [self.choice(out.new_text, out.finish_reason, True, first)])

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        return response_envelope(self.request_id, self.chunk_object_name, self.model, [],
                                 usage(out))

    def complete(self, out: RequestOutput) -> dict[str, Any]:
        return response_envelope(self.request_id, self.object_name, self.model,
                                 [self.choice(out.text, out.finish_reason, False, False)],
                                 usage(out))


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, text: str, finish_reason: str | None, delta: bool, first: bool) -> dict[str, Any]:
        return chat_choice(text, finish_reason, delta=delta, first=first)


class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"

    def choice(self, text: str, finish_reason: str | None, delta: bool, first: bool) -> dict[str, Any]:
        return completion_choice(text, finish_reason)


class EventStream(StreamingResponse):
    """A streaming response that always closes its body iterator. Starlette stops
    iterating when the client disconnects but leaves closing the generator to the garbage
    collector; closing it here aborts the request at once, returning its KV blocks."""

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self.body_iterator.aclose()


DISCONNECT_POLL_S = 0.25
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that went away


class ClientGone(Exception):
    """The client disconnected before the response started."""


async def respond(outputs: AsyncIterator[RequestOutput], body: SamplingRequest,
                  fmt: ResponseFormat, http: Request) -> Response:
    try:
        first = await _next_while_connected(outputs, http)
        if body.stream:
            return EventStream(_events(first, outputs, fmt, body.include_usage))
        last = first
        while not last.finished:
            last = await _next_while_connected(outputs, http)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(fmt.complete(last))


async def _next_while_connected(outputs: AsyncIterator[RequestOutput],
                                http: Request) -> RequestOutput:
    """The next output; if the client disconnects first, abort the request (cancelling the
    wait runs the generator's cleanup, which posts the abort) and raise ``ClientGone``."""
    pending = asyncio.ensure_future(anext(outputs))
    while not (await asyncio.wait({pending}, timeout=DISCONNECT_POLL_S))[0]:
        if await http.is_disconnected():
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
            raise ClientGone
    return pending.result()


async def _events(first: RequestOutput, outputs: AsyncIterator[RequestOutput],
                  fmt: ResponseFormat, include_usage: bool) -> AsyncIterator[str]:
    """The chunks, then ``[DONE]``. A failure after the status was sent (an engine error,
    a cluster replica that died) ends the stream with an ``{"error": {...}}`` event."""
    try:
        yield _sse(fmt.chunk(first, first=True))
        last = first
        async for last in outputs:
            yield _sse(fmt.chunk(last))
        if include_usage:
            yield _sse(fmt.usage_chunk(last))
    except APIError as exc:
        yield _sse(exc.body())
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
