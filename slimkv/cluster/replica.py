"""One engine replica on Ray Serve: the single-engine server's :class:`AsyncEngine` (engine
thread, continuous batching, aborts that free KV blocks) inside a Serve replica actor.

Every method takes a :class:`RouteHint` first, which the request router reads. ``generate``
is a streaming method: it yields the replica's name first (the ingress turns it into the
``X-Slimkv-Replica`` header), then the engine's ``RequestOutput``s, or one ``WireError``.
When the ingress cancels the call (its client went away) the cancellation reaches the
generator here and the engine request is aborted, returning its blocks.
``record_routing_stats`` is Serve's hook: the request router sees its dict
(:func:`slimkv.cluster.policy.routing_stats` of the engine's latest ``EngineStats``),
refreshed every ``cluster.stats_period_s``, as ``RunningReplica.routing_stats``.

**The shared KV tier.** With ``kv_cache.offload.disk_path`` set, every replica reads and
writes the one directory (a volume every node mounts), and writes each finished turn's
chunks through to it (``write: through``, unless the config sets ``write``): a session
whose replica died or was drained is re-routed and reloads its history from the directory
instead of recomputing it. **Shutdown.** Serve stops routing here and waits for the ongoing
requests (``graceful_shutdown_timeout_s``), then calls ``__del__``: the engine drains
(:mod:`slimkv.server.drain`) and stops, writing the chunks still pending to the tier.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from ray import serve

from slimkv.cluster.policy import routing_stats
from slimkv.cluster.wire import RouteHint, WireError, WireRequest
from slimkv.config import Config
from slimkv.engine.outputs import RequestOutput
from slimkv.plugins import build_engine
from slimkv.server.async_engine import AsyncEngine, GenerateRequest
from slimkv.server.canary import Canary
from slimkv.server.drain import drain
from slimkv.server.errors import APIError
from slimkv.server.metrics import ServerMetrics


def shared_tier(config: Config) -> Config:
    """A cluster's replicas over one disk tier write every turn through to it (a replica
    killed at any moment has then stored every turn it finished)."""
    offload = config.kv_cache.offload
    if isinstance(offload, dict) and offload.get("disk_path") and "write" not in offload:
        return config.replace("kv_cache", offload={**offload, "write": "through"})
    return config


class EngineReplica:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = shared_tier(Config.from_dict(config))
        llm_engine = build_engine(self.config)
        metrics = ServerMetrics(llm_engine.model_name)
        canary = (Canary(self.config, metrics.registry, llm_engine.model_name)
                  if self.config.canary.fraction > 0 else None)
        self.engine = AsyncEngine(llm_engine, metrics, canary=canary)
        self.engine.start()
        self.name = serve.get_replica_context().replica_id.unique_id

    def describe(self, hint: RouteHint) -> dict[str, Any]:
        return {"replica": self.name, "model_name": self.engine.model_name,
                "max_model_len": self.engine.max_model_len,
                "block_size": self.config.kv_cache.block_size}

    async def generate(self, hint: RouteHint,
                       wire: WireRequest) -> AsyncIterator[str | RequestOutput | WireError]:
        yield self.name
        request = GenerateRequest(wire.request_id, wire.prompt_ids, False,
                                  lambda _: wire.params, session_id=wire.session_id,
                                  prompt_logprobs=wire.prompt_logprobs)
        try:
            async for out in self.engine.generate(request):
                if request.prompt_info is not None:  # set on admission: before any output
                    yield request.prompt_info
                    request.prompt_info = None
                yield out
        except APIError as exc:
            yield WireError.of(exc)

    async def exposition(self, hint: RouteHint) -> bytes:
        return await self.engine.exposition()

    async def cache_state(self, hint: RouteHint, blocks: bool = True) -> dict[str, Any]:
        return {"replica": self.name, **await self.engine.cache_state(blocks)}

    async def record_routing_stats(self) -> dict[str, Any]:
        # The snapshot the engine thread took after its last step: answered at once, even
        # while a long prefill holds the engine thread (Serve times this call out).
        return routing_stats(self.engine.latest_stats)

    async def __del__(self) -> None:
        """Serve's shutdown, once the ongoing requests are done (or it gave up on them)."""
        engine = getattr(self, "engine", None)
        if engine is not None:
            await drain(engine, self.config.server.drain_timeout_s)
            await asyncio.to_thread(engine.stop)
