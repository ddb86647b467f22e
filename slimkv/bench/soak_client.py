"""The soak's client: one streamed chat turn, classified the way the soak judges it, and
multi-turn sessions over long documents.

A turn ends in exactly one way: ``ok`` (``[DONE]`` after content), ``busy`` (429 with a
``Retry-After``), ``sse_error`` (an ``{"error"}`` event then ``[DONE]``: a clean end),
``http_<status>`` (any other status), or a failure the soak never accepts: ``timeout``
(a hang: no end within the turn's deadline), ``disconnect``, ``incomplete`` (no
``[DONE]``), ``bad_stream``. Loopback only: the soak points it at its own servers.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from slimkv.loadtest.workloads import corpus
from slimkv.server.backend import REPLICA_HEADER

CHARS_PER_TOKEN = 4   # the corpus's English: about four characters a token
QUESTIONS = ("Summarize the text in one sentence.", "Name one fact the text states.",
             "What is the text's main subject?", "Quote a short phrase from it.",
             "What might the author argue next?", "List two names or terms it uses.")


@dataclass(slots=True)
class TurnResult:
    session: str
    turn: int
    start: float                       # time.monotonic() when sent
    end: float = 0.0
    status: int | None = None
    outcome: str = "incomplete"
    retry_after: str | None = None
    ttft: float | None = None
    text: str = ""
    error_code: str | None = None      # the SSE error event's code, or the error body's
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    replica: str | None = None
    first: asyncio.Event | None = field(default=None, repr=False)  # set at the first token

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"


async def send_turn(http: httpx.AsyncClient, url: str, model: str, messages: list[dict],
                    session: str, turn: int, max_tokens: int, timeout_s: float,
                    first: asyncio.Event | None = None, **fields: Any) -> TurnResult:
    """Stream one chat turn; never raises (a hang past ``timeout_s`` is ``timeout``).
    ``first`` is set when the first token arrives; ``fields`` go into the body."""
    result = TurnResult(session, turn, time.monotonic(), first=first)
    body = {"model": model, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            "session_id": session, **fields}
    try:
        await asyncio.wait_for(_stream(http, url, body, result), timeout_s)
    except asyncio.TimeoutError:
        result.outcome = "timeout"
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError,
            httpx.ConnectError) as exc:
        result.outcome = "connect" if isinstance(exc, httpx.ConnectError) else "disconnect"
    except httpx.HTTPError as exc:
        result.outcome = type(exc).__name__
    except ValueError:
        result.outcome = "bad_stream"
    result.end = time.monotonic()
    return result


async def _stream(http: httpx.AsyncClient, url: str, body: dict, result: TurnResult) -> None:
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        result.status = response.status_code
        result.replica = response.headers.get(REPLICA_HEADER)
        if response.status_code != 200:
            raw = await response.aread()
            result.retry_after = response.headers.get("retry-after")
            result.outcome = ("busy" if response.status_code == 429 and result.retry_after
                              else f"http_{response.status_code}")
            try:
                result.error_code = json.loads(raw)["error"]["code"]
            except (ValueError, KeyError, TypeError):
                pass
            return
        parts: list[str] = []
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if result.outcome == "incomplete":
                    result.outcome = "ok"
                break
            chunk = json.loads(data)
            if "error" in chunk:
                result.outcome, result.error_code = "sse_error", chunk["error"].get("code")
                continue
            _take(chunk, result, parts)
        result.text = "".join(parts)


def _take(chunk: dict, result: TurnResult, parts: list[str]) -> None:
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            if result.ttft is None:
                result.ttft = time.monotonic() - result.start
                if result.first is not None:
                    result.first.set()
            parts.append(content)


def document(index: int, tokens: int, salt: str = "") -> str:
    """A slice of the embedded corpus of about ``tokens`` tokens, different per index."""
    text = corpus()
    chars = tokens * CHARS_PER_TOKEN
    start = (index * 7919) % max(1, len(text) - chars)
    return f"{salt}Document {index}. Answer questions about it.\n\n{text[start:start + chars]}"


@dataclass(slots=True)
class Session:
    """A conversation over one document: ``messages()`` for the next turn, ``answer()``
    after a turn that succeeded (a failed turn is sent again)."""

    name: str
    doc: str
    turn: int = 1
    history: list[dict] = field(default_factory=list)

    def messages(self) -> list[dict]:
        if not self.history:
            self.history = [{"role": "system", "content": self.doc}]
        question = QUESTIONS[(self.turn - 1 + len(self.name)) % len(QUESTIONS)]
        return self.history + [{"role": "user", "content": question}]

    def answer(self, messages: list[dict], text: str) -> None:
        self.history = messages + [{"role": "assistant", "content": text}]
        self.turn += 1
