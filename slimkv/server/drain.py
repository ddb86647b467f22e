"""Graceful drain: what ``slimkv serve`` does on SIGTERM (or SIGINT), and what an engine
replica does when Ray Serve shuts it down (slimkv/cluster/replica.py).

1. **Stop admitting.** uvicorn closes its listening socket at once; a request that still
   reaches the engine gets 503 ``shutting_down`` with ``Retry-After`` (a cluster's ingress
   retries it on another replica before anything was sent).
2. **Finish or end the open streams.** Requests already admitted (running or queued) get
   ``server.drain_timeout_s`` to finish; those still open then end cleanly: a stream that
   started gets an SSE error event (``shutting_down``) and ``[DONE]``, one that did not a
   503 JSON error. Their KV blocks are freed either way.
3. **Store the sessions' KV.** :meth:`AsyncEngine.stop` closes the KV offload tier: every
   chunk still pending in the pool is written, host-tier chunks go to disk. A server
   restarted over the same ``kv_cache.offload.disk_path`` (or another replica sharing it)
   then continues those sessions with their KV instead of recomputing them.
4. **Exit**, with status 0 after a SIGTERM.

uvicorn's own graceful timeout is set past the drain's, so it never cuts a stream before
step 2 ends it; a second signal still forces the exit.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from slimkv.server.async_engine import AsyncEngine
from slimkv.server.errors import APIError

log = logging.getLogger(__name__)
POLL_S = 0.05
UVICORN_MARGIN_S = 10.0   # uvicorn's graceful timeout: the drain's plus this


def drain_error() -> APIError:
    return APIError(503, "the server is shutting down; retry the request", "shutting_down",
                    headers={"Retry-After": "1"})


async def drain(engine: AsyncEngine, timeout_s: float) -> int:
    """Steps 1 and 2: stop admitting, wait up to ``timeout_s`` for the open requests, end
    the rest; returns how many were ended."""
    engine.draining = True
    deadline = time.monotonic() + timeout_s
    open_at_start = engine.num_streams
    while engine.num_streams and time.monotonic() < deadline:
        await asyncio.sleep(POLL_S)
    ended = await engine.end_streams(drain_error()) if engine.num_streams else 0
    log.warning("drain: %d request(s) open at the start, %d ended at the %g s deadline",
                open_at_start, ended, timeout_s)
    return ended


class DrainingServer(uvicorn.Server):
    """uvicorn that drains ``engine`` (steps 1-2) on the first SIGTERM / SIGINT while it
    shuts down; its lifespan shutdown then stops the engine (step 3)."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine, timeout_s: float) -> None:
        config.timeout_graceful_shutdown = int(timeout_s + UVICORN_MARGIN_S)
        super().__init__(config)
        self.engine = engine
        self.timeout_s = timeout_s
        self.drain_task: asyncio.Task[int] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit or sig not in (signal.SIGTERM, signal.SIGINT):
            return super().handle_exit(sig, frame)   # a second signal: force the exit
        log.warning("slimkv: signal %d: draining (up to %g s)", sig, self.timeout_s)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is not None:
            loop.call_soon_threadsafe(self._start_drain)
        # Not re-raised after the shutdown (uvicorn's default): a drained exit is status 0.
        self.should_exit = True

    def _start_drain(self) -> None:
        self.drain_task = asyncio.get_running_loop().create_task(
            drain(self.engine, self.timeout_s))
