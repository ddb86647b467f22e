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
"""

from __future__ import annotations

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
from slimkv.server.errors import APIError
from slimkv.server.metrics import ServerMetrics


class EngineReplica:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = Config.from_dict(config)
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
                                  lambda _: wire.params, session_id=wire.session_id)
        try:
            async for out in self.engine.generate(request):
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

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop()
