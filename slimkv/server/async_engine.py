"""The engine loop behind the HTTP server.

``LLMEngine`` is single-threaded, so one background thread owns it. HTTP handlers never
touch the engine: they post ``GenerateRequest``s and aborts to an inbox under a condition
variable. The engine thread drains the inbox before every step (tokenizing, admission
checks, ``add_request``), steps while there is work, and sleeps on the condition when there
is none (no busy spin). Each ``RequestOutput`` goes to its request's ``asyncio.Queue``
through ``loop.call_soon_threadsafe``; errors go the same way as exceptions, which
:meth:`AsyncEngine.generate` raises in the handler. Requests that arrive while others run
simply join the running batch at the next step (continuous batching). A handler that needs
to read engine state (the cache dashboard) posts a function with :meth:`AsyncEngine.call`,
which the engine thread runs between two steps; after every step the metrics and the
``step_hooks`` get the engine's stats and the increments of its counters.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from slimkv.engine.llm_engine import LLMEngine, RequestError
from slimkv.engine.engine_stats import EngineStats
from slimkv.engine.outputs import RequestOutput
from slimkv.model.protocol import Tokenizer
from slimkv.options.tool_formats import GENERIC, ToolCallFormat
from slimkv.server.cache_state import CacheHistory
from slimkv.server.canary import Canary
from slimkv.server.errors import APIError, ServerBusy
from slimkv.server.generate_request import GenerateRequest, Item, prompt_ids
from slimkv.server.metrics import CounterDeltas, ServerMetrics
from slimkv.server.scoring import describe_prompt, score_prompt

log = logging.getLogger(__name__)

__all__ = ["AsyncEngine", "GenerateRequest"]
T = TypeVar("T")
StepHook = Callable[[EngineStats, dict[str, int], list[RequestOutput]], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, stall_poll_s: float = 0.05,
                 canary: Canary | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self.canary = canary
        self.max_queue = engine.config.scheduler.max_queue
        self.queue_timeout_s = engine.config.scheduler.queue_timeout_s
        self.stall_poll_s = stall_poll_s
        self._cond = threading.Condition()
        self._adds: list[GenerateRequest] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[LLMEngine], Any], asyncio.Future[Any]]] = []
        self.step_hooks: list[StepHook] = []  # run on the engine thread after every step
        self._deltas = CounterDeltas()
        self._streams: dict[str, GenerateRequest] = {}  # owned by the engine thread
        self._stopping = False
        self.draining = False  # set by slimkv.server.drain: new requests get 503
        self._thread = threading.Thread(target=self._run, name="slimkv-engine", daemon=True)
        self.history = CacheHistory()  # the dashboard's recent events
        self.step_hooks.append(self.history)
        # The engine's stats after the thread's last step (frozen; any thread may read it).
        self.latest_stats: EngineStats = engine.stats()
        self.tool_format: ToolCallFormat = getattr(engine.tokenizer, "tool_format", GENERIC)
        metrics.describe_engine(self.latest_stats)

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    # -- the HTTP side -------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        if self.canary:
            self.canary.start()

    @property
    def num_streams(self) -> int:
        """Requests admitted and not finished (queued or running)."""
        return len(self._streams)

    def stop(self) -> None:
        """Stop the engine thread (open requests get 503), then store the KV tier's pending."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join()
        if self.canary:
            self.canary.stop()
        if self.engine.connector is not None:
            self.engine.connector.close()

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Yield the request's outputs until it finishes. Closing the iterator early (the
        client went away) aborts the request, which frees its KV blocks."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry the request",
                           "shutting_down", headers={"Retry-After": "1"})
        request.loop = asyncio.get_running_loop()
        request.queue = asyncio.Queue()
        self._post(lambda: self._adds.append(request))
        finished = False
        try:
            while not finished:
                item = await request.queue.get()
                if isinstance(item, APIError):
                    finished = True  # the engine already dropped it
                    raise item
                finished = request.finishes(item)
                yield item
        finally:
            if not finished:
                self._post(lambda: self._aborts.append(request.request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between two steps and return its result
        (how a handler reads engine state, e.g. a cache snapshot)."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        self._post(lambda: self._calls.append((fn, future)))
        return await future

    async def cache_state(self, blocks: bool = True) -> dict[str, Any]:
        """The ``/v1/cache/state`` snapshot, built on the engine thread between two steps."""
        return await self.call(lambda e: self.history.snapshot(e.stats(), e.block_map(), blocks))

    async def exposition(self) -> bytes:
        """The Prometheus text of this engine's metrics."""
        return self.metrics.exposition()

    def _post(self, change: Callable[[], None]) -> None:
        with self._cond:
            change()
            self._cond.notify()

    # -- the engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        while self._wait_for_work():
            with self._cond:
                adds, self._adds = self._adds, []
                aborts, self._aborts = self._aborts, []
                calls, self._calls = self._calls, []
            self.metrics.record_aborts(sum(self._abort(rid) for rid in aborts))
            for request in adds:
                self._add(request)
            self._expire_queued()
            for fn, future in calls:
                self._answer(fn, future)
            outputs = self._step() if self.engine.has_unfinished() else []
            for out in outputs:
                self._deliver(out)
            self._forget_finished(outputs)
            stats = self.latest_stats = self.engine.stats()
            deltas = self._deltas(stats)
            self.metrics.update(stats, deltas, outputs)
            for hook in self.step_hooks:
                hook(stats, deltas, outputs)
        self._fail_all(APIError(503, "the server is shutting down", "shutting_down"))

    def _wait_for_work(self) -> bool:
        """Sleep until there is something to do; False when stopping. When only requests
        that cannot be admitted yet remain, poll slowly (for queue timeouts) instead of spinning."""
        with self._cond:
            stalled = self.engine.has_unfinished() and not self.engine.stats().num_running
            if stalled and not (self._adds or self._aborts or self._calls):
                self._cond.wait(self.stall_poll_s)
            while not (self._adds or self._aborts or self._calls or self.engine.has_unfinished()
                       or self._stopping):
                self._cond.wait()
            return not self._stopping

    def _answer(self, fn: Callable[[LLMEngine], Any], future: asyncio.Future[Any]) -> None:
        """Run a posted call; its result or exception goes back to the handler's loop."""
        try:
            outcome, value = future.set_result, fn(self.engine)
        except Exception as exc:
            outcome, value = future.set_exception, exc
        if not future.get_loop().is_closed():
            future.get_loop().call_soon_threadsafe(
                lambda: None if future.done() else outcome(value))  # done: the handler gave up

    def _add(self, request: GenerateRequest) -> None:
        waiting = self.engine.stats().num_waiting
        if self.max_queue is not None and waiting >= self.max_queue:
            request.deliver(ServerBusy(f"server busy: {waiting} requests already queued "
                                       f"(scheduler.max_queue={self.max_queue}); retry later"))
            return
        try:
            request.prompt_ids = prompt_ids(self.engine.tokenizer, request)
            request.params = request.make_params(len(request.prompt_ids))
            if request.wants_prompt:
                self._describe_prompt(request)
            self.engine.add_request(request.prompt_ids, request.params, request.request_id,
                                    request.session_id)
        except APIError as exc:
            request.deliver(exc)
            return
        except RequestError as exc:
            request.deliver(APIError(400, str(exc), "invalid_prompt"))
            return
        except ValueError as exc:
            request.deliver(APIError(400, str(exc), "invalid_value"))
            return
        except Exception:  # a bug must not take the engine thread down
            log.exception("could not add request %s", request.request_id)
            request.deliver(APIError(500, "internal error adding the request", "internal_error"))
            return
        self._streams[request.request_id] = request

    def _describe_prompt(self, request: GenerateRequest) -> None:
        """``echo`` / ``prompt_logprobs``: the prompt's text and tokens, and its
        teacher-forced log-probabilities (slimkv.server.scoring), before the request runs."""
        ids, k = request.prompt_ids, request.prompt_logprobs
        self.engine.check_request(ids, request.params)
        try:
            scores = None if k is None else score_prompt(self.engine, ids, k)
        except RequestError as exc:  # no free KV blocks for the scoring pass right now
            raise ServerBusy(f"server busy: {exc}; retry later") from exc
        text = request.prompt if isinstance(request.prompt, str) and not request.chat else None
        request.prompt_info = describe_prompt(self.engine.tokenizer, ids, text, scores)

    async def tokenizer_call(self, fn: Callable[[Tokenizer], T]) -> T:
        """``fn(tokenizer)`` on the engine thread (``/tokenize``, ``/detokenize``)."""
        return await self.call(lambda engine: fn(engine.tokenizer))

    def _abort(self, request_id: str) -> bool:
        if self._streams.pop(request_id, None) is None:
            return False
        self.engine.abort_request(request_id)
        return True

    def _expire_queued(self) -> None:
        """``scheduler.queue_timeout_s``: never-scheduled requests waiting longer get 429."""
        if self.queue_timeout_s is None:
            return
        for request_id in self.engine.unscheduled_since(time.monotonic() - self.queue_timeout_s):
            request = self._streams[request_id]
            self._abort(request_id)
            request.deliver(ServerBusy(
                f"server busy: the request waited over {self.queue_timeout_s:g} s in the "
                "queue (scheduler.queue_timeout_s); retry later"))

    def _step(self) -> list[RequestOutput]:
        try:
            return self.engine.step()
        except Exception:  # a bug, not bad input: fail the batch but keep serving
            log.exception("engine step failed; aborting %d requests", len(self._streams))
            self._fail_all(APIError(500, "internal engine error", "internal_error"))
            return []

    def _deliver(self, out: RequestOutput) -> None:
        request = self._streams.get(out.request_id)
        if request is None:
            return
        if out.finished and out.index == 0 and self.canary:
            self.canary.offer(request.prompt_ids, request.params, out.token_ids,
                              out.finish_reason)
        request.deliver(out)

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        """Drop the streams of requests whose every choice has ended (several may end in
        one step, so only after all the step's outputs are delivered)."""
        for request_id in {out.request_id for out in outputs if out.finished}:
            if not self.engine.has_request(request_id):
                self._streams.pop(request_id, None)

    async def end_streams(self, error: APIError) -> int:
        """End every open request with ``error`` (on the engine thread); how many were."""
        return await self.call(lambda _: self._fail_all(error))

    def _fail_all(self, error: APIError) -> int:
        streams = list(self._streams.items())
        for request_id, request in streams:
            self._abort(request_id)
            request.deliver(error)
        return len(streams)
