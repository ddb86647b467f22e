"""The closed loop: ``concurrency`` clients, each sending its next turn as soon as the
previous one finished, for ``duration`` seconds.

Everything is bounded: no request starts after the window closes, requests still in
flight then are cancelled (the dropped connection lets the server abort them) and marked
``cancelled``, each request has a timeout, and ``max_requests`` caps a level's count. A
failed request is followed by a short pause so a dead server is not hammered in a spin.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

from slimkv.loadtest.client import ChatClient, RequestResult
from slimkv.loadtest.workloads import ClientWorkload, Turn, WorkloadSpec, corpus

ERROR_PAUSE_S = 0.1


@dataclass(frozen=True, slots=True)
class RunSpec:
    url: str
    model: str
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    duration: float = 60.0
    warmup: float = 0.0               # requests started earlier are load, not statistics
    request_timeout: float = 120.0
    max_requests: int = 100_000
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    session_header: bool = False      # send X-Session-ID (slimkv's session affinity)
    think_time: float = 0.0           # mean pause after each answered turn (0.5-1.5x, seeded)

    def __post_init__(self) -> None:
        if urlparse(self.url).scheme not in ("http", "https"):
            raise ValueError(f"--url must be an http(s) URL, got {self.url!r}")
        if not 0 <= self.warmup < self.duration:
            raise ValueError("warmup must be at least 0 and shorter than the duration")


@dataclass(slots=True)
class LevelRun:
    """Raw results of one concurrency level; ``start``/``end`` bound the window."""

    concurrency: int
    start: float
    end: float
    warmup: float
    results: list[RequestResult]

    @property
    def measured(self) -> list[RequestResult]:
        return [r for r in self.results if r.start >= self.start + self.warmup]


async def run_level(spec: RunSpec, concurrency: int,
                    on_result: Callable[[RequestResult], None] | None = None) -> LevelRun:
    text = corpus()
    results: list[RequestResult] = []
    timeout = httpx.Timeout(spec.request_timeout, connect=min(10.0, spec.request_timeout))
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        client = ChatClient(http, spec.url, spec.model, spec.api_key, spec.extra_body,
                            spec.session_header)
        start = time.monotonic()
        deadline = start + spec.duration

        async def loop(index: int) -> None:
            workload = ClientWorkload(spec.workload, concurrency, index, text)
            think = random.Random(f"think:{spec.workload.seed}:{concurrency}:{index}")
            while time.monotonic() < deadline and len(results) < spec.max_requests:
                turn = workload.next_turn()
                result = RequestResult(turn.session, time.monotonic(), turn.turn)
                results.append(result)
                await _send(client, turn, result)
                if on_result is not None:
                    on_result(result)
                if result.ok:
                    workload.record(result.text, result.total_tokens)
                    pause = spec.think_time * think.uniform(0.5, 1.5)
                    await asyncio.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                else:
                    workload.fail()
                    await asyncio.sleep(min(ERROR_PAUSE_S, max(0.0, deadline - time.monotonic())))

        tasks = [asyncio.create_task(loop(i)) for i in range(concurrency)]
        _, pending = await asyncio.wait(tasks, timeout=spec.duration)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        end = min(time.monotonic(), deadline)
    return LevelRun(concurrency, start, end, spec.warmup, results)


async def _send(client: ChatClient, turn: Turn, result: RequestResult) -> None:
    try:
        await client.send(turn, result)
    except asyncio.CancelledError:
        result.cancelled = True
        result.end = time.monotonic()
        raise
