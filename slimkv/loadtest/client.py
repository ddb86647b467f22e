"""One streamed chat completion, timed: TTFT, the gap between content chunks, end to end.

Works against any OpenAI-compatible server (slimkv, vLLM, llama.cpp's server): it asks for
``stream_options.include_usage`` to get exact token counts and falls back to counting
content chunks when the server sends no usage. Failures never raise; they are classified
into an ``error`` kind so a run can count them: ``http_<status>``, ``timeout``, ``connect``
(nothing listening), ``disconnect`` (the connection dropped mid-response), ``stream_error``
(an error object inside the stream), ``bad_stream`` (a chunk that is not JSON) and
``incomplete`` (the stream ended without ``[DONE]``).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from slimkv.loadtest.workloads import Turn
from slimkv.server.backend import REPLICA_HEADER


@dataclass(slots=True)
class RequestResult:
    session: str
    start: float                      # time.monotonic() when the request was sent
    turn: int = 1                     # the request's turn in its session
    end: float = 0.0
    ttft: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    text: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, if sent
    replica: str | None = None        # the X-Slimkv-Replica header of a slimkv cluster
    error: str | None = None
    cancelled: bool = False           # cut off by the end of the measurement window

    @property
    def ok(self) -> bool:
        return self.error is None and not self.cancelled

    @property
    def output_tokens(self) -> int:
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def total_tokens(self) -> int | None:
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return self.prompt_tokens + self.completion_tokens

    def inter_token_latencies(self) -> list[float]:
        """Chunk-to-chunk gaps, each divided by the tokens the later chunk is assumed to
        carry when the server reports more tokens than it sent chunks."""
        gaps = [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]
        if not gaps:
            return []
        per_chunk = max(1.0, (self.output_tokens - 1) / len(gaps))
        return [g / per_chunk for g in gaps]


def _error_kind(exc: Exception) -> str:
    if isinstance(exc, httpx.TimeoutException):
        return "timeout"
    if isinstance(exc, httpx.ConnectError):
        return "connect"
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        return "disconnect"
    if isinstance(exc, ValueError):
        return "bad_stream"
    return type(exc).__name__


class ChatClient:
    """Streams chat completions from ``{url}/v1/chat/completions``."""

    def __init__(self, http: httpx.AsyncClient, url: str, model: str,
                 api_key: str | None = None, extra_body: dict[str, Any] | None = None,
                 session_header: bool = False) -> None:
        self.http = http
        self.endpoint = f"{url.rstrip('/')}/v1/chat/completions"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.extra_body = extra_body or {}
        self.session_header = session_header  # send each turn's session as X-Session-ID

    async def send(self, turn: Turn, result: RequestResult) -> RequestResult:
        """Fill ``result`` in place (so a cancelled request keeps what it received)."""
        body = {"model": self.model, "messages": turn.messages, "max_tokens": turn.max_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
                **self.extra_body}
        headers = {**self.headers, "X-Session-ID": turn.session} if self.session_header \
            else self.headers
        try:
            async with self.http.stream("POST", self.endpoint, json=body,
                                        headers=headers) as response:
                result.replica = response.headers.get(REPLICA_HEADER)
                if response.status_code != 200:
                    await response.aread()
                    result.error = f"http_{response.status_code}"
                else:
                    await self._read_stream(response, result)
        except (httpx.HTTPError, ValueError) as exc:  # ValueError: a chunk that is not JSON
            result.error = _error_kind(exc)
        result.end = time.monotonic()
        return result

    async def _read_stream(self, response: httpx.Response, result: RequestResult) -> None:
        parts: list[str] = []
        done = False
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.error = "stream_error"
                return
            self._take_chunk(chunk, result, parts)
        result.text = "".join(parts)
        if not done:
            result.error = "incomplete"

    @staticmethod
    def _take_chunk(chunk: dict[str, Any], result: RequestResult, parts: list[str]) -> None:
        usage = chunk.get("usage")
        if usage:
            result.prompt_tokens = usage.get("prompt_tokens")
            result.completion_tokens = usage.get("completion_tokens")
            result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in chunk.get("choices") or []:
            content = (choice.get("delta") or {}).get("content")
            if content:
                now = time.monotonic()
                if result.ttft is None:
                    result.ttft = now - result.start
                result.chunk_times.append(now)
                parts.append(content)
