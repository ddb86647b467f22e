"""Turning a request's stream of engine outputs into an HTTP response: one JSON body, or
server-sent events (``data: {chunk}`` lines ending with ``data: [DONE]``).

The first output is awaited before any byte is sent, so a request the engine rejects
(400) or that finds the server busy (429) gets a real error status even when streaming.
While no byte has been sent (queued, prefilling, or a whole non-streaming answer), the
client's connection is watched: if it goes away the request is aborted at once, so an
abandoned request neither keeps its place in the queue nor holds KV blocks.

A list of prompts is one engine request per prompt; their outputs are merged as they come,
choice ``i`` of prompt ``p`` becoming choice ``p * n + i``. ``echo`` puts the prompt (and its
logprobs) before each choice's text: in the choice's first chunk when streaming.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Send

from slimkv.engine.outputs import RequestOutput, TokenLogprob
from slimkv.server.errors import APIError
from slimkv.server.generate_request import GenerateRequest
from slimkv.server.payloads import (chat_choice, completion_choice, echo_logprobs,
                                    prompt_logprobs, response_envelope, usage)
from slimkv.server.protocol import SamplingRequest
from slimkv.server.scoring import PromptInfo


@dataclass(slots=True)
class ResponseFormat:
    """Shapes outputs as one endpoint's objects; subclasses give the choice layout."""

    request_id: str
    model: str
    n: int = 1                                   # choices per prompt
    requests: list[GenerateRequest] = field(default_factory=list)  # one per prompt
    prompt_logprobs: int | None = None           # vLLM's prompt_logprobs, when asked
    echo_only: bool = False                      # echo with max_tokens 0: the prompt only
    object_name = ""
    chunk_object_name = ""

    def prompt(self, index: int) -> PromptInfo | None:
        """The prompt of choice ``index`` as the backend described it (echo, logprobs)."""
        return self.requests[index // self.n].prompt_info if self.requests else None

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
                                 usage(finals, self.n, self.echo_only))

    def complete(self, finals: list[RequestOutput],
                 logprobs: dict[int, list[TokenLogprob]]) -> dict[str, Any]:
        choices = [self.choice(out.index, out.text, out.finish_reason, logprobs.get(out.index),
                               False, False) for out in finals]
        return response_envelope(self.request_id, self.object_name, self.model, choices,
                                 usage(finals, self.n, self.echo_only))


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def choice(self, index: int, text: str, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None, delta: bool, first: bool) -> dict[str, Any]:
        return chat_choice(index, text, finish_reason, logprobs, delta=delta, first=first)

    def complete(self, finals: list[RequestOutput],
                 logprobs: dict[int, list[TokenLogprob]]) -> dict[str, Any]:
        body = ResponseFormat.complete(self, finals, logprobs)
        if self.prompt_logprobs is not None:  # vLLM puts chat's beside the choices
            body["prompt_logprobs"] = prompt_logprobs(self.prompt(0), self.prompt_logprobs)
        return body


@dataclass(slots=True)
class CompletionFormat(ResponseFormat):
    object_name = "text_completion"
    chunk_object_name = "text_completion"
    offsets: dict[int, int] = field(default_factory=dict)  # streamed text so far, per choice
    echo: bool = False
    echo_k: int = 0                              # alternatives per echoed token (logprobs)

    def choice(self, index: int, text: str, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None, delta: bool, first: bool) -> dict[str, Any]:
        if self.echo_only:  # the one token generated past the prompt is not shown
            text, logprobs = "", None if logprobs is None else []
        prompt = self.prompt(index) if self.echo and (first or not delta) else None
        if prompt is not None:
            text = prompt.text + text
            if logprobs is not None:
                logprobs = echo_logprobs(prompt, self.echo_k) + logprobs
        offset = self.offsets.get(index, 0) if delta else 0
        if delta and logprobs:
            self.offsets[index] = offset + sum(len(t.token) for t in logprobs)
        choice = completion_choice(index, text, finish_reason, logprobs, offset)
        if self.prompt_logprobs is not None and not delta:
            choice["prompt_logprobs"] = prompt_logprobs(self.prompt(index), self.prompt_logprobs)
        return choice


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


async def merge_outputs(streams: list[AsyncIterator[RequestOutput]], n: int,
                        stagger: bool = False) -> AsyncIterator[RequestOutput]:
    """The outputs of one request per prompt as they come, choice ``i`` of prompt ``p``
    renumbered ``p * n + i``. A failure of one ends all; closing this closes (aborts) all.
    ``stagger``: prompt ``p + 1``'s request starts once prompt ``p``'s has answered (a
    cluster: Ray Serve matches a routed call to its waiter by the HTTP request's id, which
    concurrent calls from one request share, so one of them could wait forever)."""
    started = 1 if stagger else len(streams)
    pending = {asyncio.ensure_future(anext(s)): p for p, s in enumerate(streams[:started])}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.get):
                p = pending.pop(future)
                if p + 1 == started < len(streams):  # routed and answering: start the next
                    pending[asyncio.ensure_future(anext(streams[started]))] = started
                    started += 1
                try:
                    out = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[p]))] = p
                yield dataclasses.replace(out, index=p * n + out.index) if p else out
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def respond(outputs: AsyncIterator[RequestOutput], body: SamplingRequest,
                  fmt: ResponseFormat, http: Request, num_choices: int | None = None
                  ) -> Response:
    """The response to a request with ``num_choices`` choices (default ``body.n``): each
    choice's outputs come in order, interleaved with the others'; the request ends when
    every choice has."""
    num_choices = num_choices or body.n
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
            if len(finals) == num_choices and all(o.finished for o in finals.values()):
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
