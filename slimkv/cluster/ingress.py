"""The cluster's HTTP front: the single-engine server's FastAPI app (same routes, SSE,
API key, error shapes, ``/health``) over a :class:`ClusterBackend` instead of one engine.

The backend tokenizes each prompt (the chat template applied, as the engine would), hashes
its first blocks for the request router and streams the call to the chosen engine replica.
A replica that fails (or is draining) before the request produced anything is retried once
on another replica (nothing was sent yet, so the retry is invisible); one that fails
mid-stream ends the response with a 503 error (an SSE error event when streaming). ``/metrics`` and
``/v1/cache/state`` fan out to every live replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError, RayError
from ray.serve.handle import DeploymentHandle

from slimkv.cluster.exposition import merge_expositions
from slimkv.cluster.hashing import routing_hashes
from slimkv.cluster.policy import RouteKeys
from slimkv.cluster.router import ROUTERS
from slimkv.cluster.wire import RouteHint, WireError, WireRequest
from slimkv.config import Config
from slimkv.model_io.loader import load_tokenizer
from slimkv.engine.outputs import RequestOutput
from slimkv.model.protocol import Tokenizer
from slimkv.server.app import create_app
from slimkv.server.async_engine import GenerateRequest
from slimkv.server.generate_request import prompt_ids
from slimkv.server.scoring import PromptInfo, describe_prompt
from slimkv.server.errors import APIError

log = logging.getLogger(__name__)
T = TypeVar("T")
FANOUT_TIMEOUT_S = 2.0  # per replica; a dead one is left out of that answer
REPLICA_LOST = (RayActorError, ActorDiedError, ActorUnavailableError)


class ReplicaLost(Exception):
    """The replica serving a request died or became unreachable."""


class ClusterBackend:
    # A list of prompts is one call per prompt: one at a time to the router (see
    # slimkv.server.responses.merge_outputs), as _each does for its fan-out.
    routes_one_call_at_a_time = True

    def __init__(self, engines: DeploymentHandle, config: Config, info: dict[str, Any],
                 app_name: str) -> None:
        self.engines = engines
        self.tokenizer = load_tokenizer(config.model.path)
        self.tool_format = self.tokenizer.tool_format
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.block_size: int = info["block_size"]
        self.routing_blocks = config.cluster.routing_blocks
        self.app_name = app_name
        self.registry = CollectorRegistry()
        self.replicas_up = Gauge("slimkv:cluster_replicas", "Engine replicas the router sees.",
                                 registry=self.registry)
        self.unreachable = Counter("slimkv:cluster_replicas_unreachable",
                                   "Replicas left out of a fan-out (timeout or failure).",
                                   registry=self.registry)
        self.decisions = Counter("slimkv:router_decisions", "Routing decisions by reason.",
                                 ["reason"], registry=self.registry)
        self._decided: dict[str, int] = {}

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    async def tokenizer_call(self, fn: Callable[[Tokenizer], T]) -> T:
        return fn(self.tokenizer)  # the ingress's own copy: no engine to wait for

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        wire, keys = self._prepare(request)
        for attempt in (1, 2):
            produced = False
            try:
                async with aclosing(self._stream(request, wire, keys)) as outputs:
                    async for out in outputs:  # closed at once if our caller stops early
                        produced = True
                        yield out
                return
            except ReplicaLost as exc:
                if produced or attempt == 2:
                    raise APIError(503, f"engine replica {request.replica} failed during the "
                                   f"request ({exc}); retry it", "replica_unavailable",
                                   headers={"Retry-After": "1"}) from exc
                log.warning("replica %s failed before answering; retrying", request.replica)

    def _prepare(self, request: GenerateRequest) -> tuple[WireRequest, RouteKeys]:
        try:
            ids = prompt_ids(self.tokenizer, request)
            params = request.params = request.make_params(len(ids))
        except ValueError as exc:
            raise APIError(400, str(exc), "invalid_value") from exc
        if request.echo and request.prompt_logprobs is None:  # else the replica's scores
            request.prompt_info = describe_prompt(self.tokenizer, ids, self._text(request))
        keys = RouteKeys(request.session_id,
                         routing_hashes(ids, self.block_size, self.routing_blocks))
        return WireRequest(request.request_id, ids, params, request.session_id,
                           request.prompt_logprobs), keys

    @staticmethod
    def _text(request: GenerateRequest) -> str | None:
        """A text prompt as sent (echo shows it); None: decode the ids."""
        return request.prompt if isinstance(request.prompt, str) and not request.chat else None

    async def _stream(self, request: GenerateRequest, wire: WireRequest,
                      keys: RouteKeys) -> AsyncIterator[RequestOutput]:
        stream = self.engines.options(stream=True).generate.remote(RouteHint(keys), wire)
        finished = False
        try:
            async for item in stream:
                if isinstance(item, str):
                    request.replica = item
                    continue
                if isinstance(item, PromptInfo):  # the replica's scoring of the prompt
                    item.text = self._text(request) or item.text
                    request.prompt_info = item
                    continue
                if isinstance(item, WireError):
                    finished = True
                    if item.code == "shutting_down":   # a replica draining: try another
                        raise ReplicaLost("draining")
                    raise item.error()
                finished = request.finishes(item)
                yield item
        except REPLICA_LOST as exc:
            finished = True
            raise ReplicaLost(type(exc).__name__) from exc
        except RayError as exc:
            finished = True
            log.error("engine replica %s failed: %s", request.replica, exc)
            raise APIError(500, "internal engine error", "internal_error") from exc
        finally:
            if not finished:
                stream.cancel()  # the replica aborts the request and frees its blocks

    # -- fan-out to every replica ----------------------------------------------------------

    def replica_names(self) -> list[str]:
        router = ROUTERS.get(self.app_name)
        return router.replica_names() if router is not None else []

    async def _each(self, method: str, *args: Any) -> dict[str, Any]:
        """``method`` on every live replica, one after the other: calls made concurrently
        from one HTTP request share Serve's internal request id, which the router uses to
        match a routed call to its waiter, so concurrent pinned calls could be lost."""
        out = {}
        for name in self.replica_names():
            call = getattr(self.engines, method).remote(RouteHint(target=name), *args)
            try:
                out[name] = await asyncio.wait_for(call, FANOUT_TIMEOUT_S)
            except (asyncio.TimeoutError, RayError) as exc:
                self.unreachable.inc()
                log.warning("replica %s did not answer %s: %r", name, method, exc)
        return out

    async def exposition(self) -> bytes:
        texts = await self._each("exposition")
        self.replicas_up.set(len(self.replica_names()))
        router = ROUTERS.get(self.app_name)
        for reason, count in (router.decisions.items() if router is not None else ()):
            self.decisions.labels(reason).inc(count - self._decided.get(reason, 0))
            self._decided[reason] = count
        return merge_expositions(texts, generate_latest(self.registry))

    async def cache_state(self, blocks: bool = True) -> dict[str, Any]:
        states = await self._each("cache_state", blocks)
        return {"schema_version": 1, "time": time.time(), "model": self.model_name,
                "replicas": [states[name] for name in sorted(states)]}


@serve.ingress()
class Ingress:
    """The HTTP ingress deployment; its app is built once the engines answer."""

    async def __init__(self, engines: DeploymentHandle, config: dict[str, Any]) -> None:
        info = await engines.describe.remote(RouteHint())
        app_name = serve.get_replica_context().app_name
        self.backend = ClusterBackend(engines, Config.from_dict(config), info, app_name)
        self.server_config = Config.from_dict(config).server

    def __serve_build_asgi_app__(self):
        return create_app(self.backend, self.server_config)
