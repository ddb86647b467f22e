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
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Send

from slimkv.engine.outputs import RequestOutput, TokenLogprob
from slimkv.server.errors import APIError
from slimkv.server.payloads import chat_choice, completion_choice, response_envelope, usage
from slimkv.server.protocol import SamplingRequest


@dataclass(slots=True)
class ResponseFormat:
    """Shapes outputs as one endpoint's objects; subclasses give the choice layout."""

    request_id: str
    model: str
    object_name = ""
    chunk_object_name = ""

    def choice(self, index: int, text: str, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None, delta: bool, first: bool) -> dict[str, Any]:
        raise NotImplementedError

    def chunk(self, out: RequestOutput, first: bool = False) -> dict[str, Any]:
        return response_envelope(self.request_id, self.chunk_object_name, self.model, [
            self.choice(out.index, out.new_text, out.finish_reason, out.logprobs, True, first)])

    def chunks(self, out: RequestOutput, first: bool = False) -> list[dict[str, Any]]:
        """The stream's chunks for one output (tool calls may take several)."""
        return [self.chunk(out, first)]

    def feed(self, out: RequestOutput) -> Any:
        """See every output of an unstreamed reply before :meth:`complete` (tool calls)."""

    def usage_chunk(self, finals: list[RequestOutput]) -> dict[str, Any]:
        return response_envelope(self.request_id, self.chunk_object_name, self.model, [],
                                 usage(finals))

    def complete(self, finals: list[RequestOutput],
                 logprobs: dict[int, list[TokenLogprob]]) -> dict[str, Any]:
        choices = [self.choice(out.index, out.text, out.finish_reason, logprobs.get(out.index),
                               False, False) for out in finals]
        return response_envelope(self.request_id, self.object_name, self.model, choices,
                                 usage(finals))


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, index: int, text: str, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None, delta: bool, first: bool) -> dict[str, Any]:
        return chat_choice(index, text, finish_reason, logprobs, delta=delta, first=first)


@dataclass(slots=True)
class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    offsets: dict[int, int] = field(default_factory=dict)  # streamed text so far, per choice

    def choice(self, index: int, text: str, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None, delta: bool, first: bool) -> dict[str, Any]:
        offset = self.offsets.get(index, 0) if delta else 0
        if delta and logprobs:
            self.offsets[index] = offset + sum(len(t.token) for t in logprobs)
        return completion_choice(index, text, finish_reason, logprobs, offset)


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
    """The response to a request with ``body.n`` choices: each choice's outputs come in
    order, interleaved with the others'; the request ends when every choice has."""
    try:
        first = await _next_while_connected(outputs, http)
        if body.stream:
            return EventStream(_events(first, outputs, fmt, body))
        finals: dict[int, RequestOutput] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        out = first
        while True:
            finals[out.index] = out
            fmt.feed(out)
            if out.logprobs is not None:
                logprobs.setdefault(out.index, []).extend(out.logprobs)
            if len(finals) == body.n and all(o.finished for o in finals.values()):
                break
            out = await _next_while_connected(outputs, http)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(fmt.complete([finals[i] for i in sorted(finals)], logprobs))


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
                  fmt: ResponseFormat, body: SamplingRequest) -> AsyncIterator[str]:
    """The chunks, then ``[DONE]``. A failure after the status was sent (an engine error,
    a cluster replica that died) ends the stream with an ``{"error": {...}}`` event."""
    finals = {first.index: first}
    try:
        for chunk in fmt.chunks(first, first=True):
            yield _sse(chunk)
        async for out in outputs:
            for chunk in fmt.chunks(out, first=out.index not in finals):
                yield _sse(chunk)
            finals[out.index] = out
        if body.include_usage:
            yield _sse(fmt.usage_chunk([finals[i] for i in sorted(finals)]))
    except APIError as exc:
        yield _sse(exc.body())
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
