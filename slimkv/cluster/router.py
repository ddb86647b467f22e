"""Ray Serve request routers for the engine replicas (``request_router_config``).

The router lives in the process that holds the deployment handle (the ingress). Both
routers honour ``RouteHint.target`` (calls the ingress fans out to every replica: metrics,
cache state) and register themselves in :data:`ROUTERS`, so the ingress can list the live
replicas. For requests:

- :class:`SlimkvRouter` applies :func:`slimkv.cluster.policy.route`: the chosen replica as
  the first rank, the others (least loaded first) as the fallback rank, which Ray takes when
  the first is at ``max_ongoing_requests``. Load is the larger of this router's own count
  of requests outstanding on a replica (exact and immediate) and the running + waiting
  count the replica last reported (covers other ingresses); KV usage and the watermark come
  from the replica's routing stats (``policy.routing_stats`` of its engine's stats
  snapshot, ``ReplicaLoad.from_routing_stats``).
- :class:`PowerOfTwoRouter` is Ray Serve's default (power of two choices on queue length),
  unchanged; the benchmark's baseline.
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

from ray.serve._private.request_router.pow_2_router import PowerOfTwoChoicesRequestRouter
from ray.serve.request_router import (PendingRequest, ReplicaID, ReplicaResult, RequestRouter,
                                      RunningReplica)

from slimkv.cluster.policy import Balance, PrefixIndex, ReplicaLoad, RouteKeys, route
from slimkv.cluster.wire import RouteHint

ROUTERS: dict[str, TargetMixin] = {}  # app name -> the engine replicas' router here


def hint_of(request: PendingRequest | None) -> RouteHint:
    if request is not None and request.args and isinstance(request.args[0], RouteHint):
        return request.args[0]
    return RouteHint()


class TargetMixin:
    """Pinned calls and the registry; mixed into both routers."""

    decisions: Counter[str]

    def initialize_state(self, **kwargs: Any) -> None:
        self.decisions = Counter()
        # Serve ships this class to the ingress by value (cloudpickle), so this method's
        # globals are a copy: register in the imported module, where the ingress looks.
        importlib.import_module(__name__).ROUTERS[self.app_name] = self

    def replica_names(self) -> list[str]:
        return sorted(rid.unique_id for rid in self.curr_replicas)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None
                              ) -> list[list[RunningReplica]]:
        """A pinned call's target (an empty rank while it is not up), else ``choose``."""
        target = hint_of(pending_request).target
        if target is None:
            return await self.choose(candidate_replicas, pending_request)
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # back off, not a spin
        return [[r for r in candidate_replicas if r.replica_id.unique_id == target]]

    async def choose(self, candidates: list[RunningReplica],
                     request: PendingRequest | None) -> list[list[RunningReplica]]:
        raise NotImplementedError


class SlimkvRouter(TargetMixin, RequestRouter):
    def initialize_state(self, abs_requests: int, rel: float, **kwargs: Any) -> None:
        super().initialize_state(**kwargs)
        self.balance = Balance(abs_requests, rel)
        self.index = PrefixIndex()
        self.outstanding: Counter[str] = Counter()

    async def choose(self, candidate_replicas: list[RunningReplica],
                     pending_request: PendingRequest | None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_name = {r.replica_id.unique_id: r for r in candidate_replicas}
        decision = route(hint_of(pending_request).keys,
                         [self._load(name, r) for name, r in by_name.items()],
                         self.index, self.balance)
        self.decisions[decision.reason] += 1
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True
        return [[by_name[decision.replica]], [by_name[n] for n in decision.ranked[1:]]]

    def _load(self, name: str, replica: RunningReplica) -> ReplicaLoad:
        stats = replica.routing_stats or {}
        if stats.get("num_blocks"):  # remember at most a pool's worth of blocks per replica
            self.index.capacity = int(stats["num_blocks"])
        return ReplicaLoad.from_routing_stats(name, stats, self.outstanding[name])

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        hint = hint_of(pending_request)
        if hint.target is None:
            self.outstanding[replica_id.unique_id] += 1
            self.index.record(replica_id.unique_id, hint.keys.block_hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        name = replica_id.unique_id
        if self.outstanding[name] > 0:
            self.outstanding[name] -= 1

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.forget(replica_id.unique_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        live = {r.replica_id.unique_id for r in replicas}
        for name in set(self.index.replicas()) | set(self.outstanding):
            if name not in live:
                self.forget(name)

    def forget(self, name: str) -> None:
        self.index.drop(name)
        self.outstanding.pop(name, None)


class PowerOfTwoRouter(TargetMixin, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router, plus pinned calls."""

    async def choose(self, candidates: list[RunningReplica],
                     request: PendingRequest | None) -> list[list[RunningReplica]]:
        self.decisions["pow2"] += 1
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidates, request)


ROUTER_CLASSES = {"slimkv": "slimkv.cluster.router:SlimkvRouter",
                  "pow2": "slimkv.cluster.router:PowerOfTwoRouter"}


def router_kwargs(name: str, balance: Balance) -> dict[str, Any]:
    return {"abs_requests": balance.abs_requests, "rel": balance.rel} if name == "slimkv" else {}
