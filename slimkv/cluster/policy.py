"""Which replica serves a request: a pure function of the request's routing keys, each
replica's load and an approximate map of what each replica's prefix cache holds.

No Ray here (only the config dataclass, for the defaults, and the engine's stats snapshot,
for :func:`routing_stats`). The Ray Serve router (``slimkv/cluster/router.py``) and the
multi-replica simulator call :func:`route` the same way: build :class:`RouteKeys` for the
request, a :class:`ReplicaLoad` per live replica, keep one :class:`PrefixIndex`, then
``decision = route(keys, loads, index, Balance.from_config(ClusterConfig()))`` and
``index.record(decision.replica, keys.block_hashes)``.

The rule:

1. **Affinity.** A request with a session id goes to its session's home, chosen by
   rendezvous (highest-random-weight) hashing of the id over the live replicas: every
   turn lands where the session's history is cached, removing a replica moves only the
   sessions that lived on it, and adding one moves about 1/N of them (to the new one). A
   request without a session goes to the replica believed to hold the longest run of its
   prompt's leading blocks (the chained block hashes recorded for earlier requests routed
   there), ties (no match anywhere, or a shared system prompt cached everywhere) broken by
   rendezvous hashing of its deepest routed block, so different documents spread out.
2. **Load.** The affine choice yields to the least-loaded replica when it is overloaded:
   ``load - least > balance.abs_requests and load > balance.rel * least`` (SGLang's
   cache-aware router has the same shape with 64 and 1.5), or when its KV usage is over
   the watermark (admission paused) while another replica's is not. A session that
   yielded goes home again on its next turn once the imbalance is gone.

Thresholds (:class:`Balance`): SGLang's absolute 64 is sized for GPU replicas that run
hundreds of sequences at once, a quarter of a 256-request batch or less. A slimkv replica
runs ``max_concurrency_soft`` (48) sequences, and a turn that loses its prefix recomputes
its whole history (thousands of tokens for the long-document sessions), so we keep the
same proportion: 12 outstanding requests more than the least-loaded replica, and SGLang's
relative 1.5 so that small absolute differences at low load never move a session.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from slimkv.cluster.config import ClusterConfig
from slimkv.engine.engine_stats import EngineStats

DEFAULT_PREFIX_CAPACITY = 65536  # blocks remembered per replica when its pool size is unknown


@dataclass(frozen=True, slots=True)
class RouteKeys:
    """What the router knows of a request: its session (if any) and the chained hashes of
    its prompt's first full blocks (``slimkv.cluster.hashing.routing_hashes``)."""

    session_id: str | None = None
    block_hashes: tuple[Hashable, ...] = ()

@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """A live replica: outstanding requests (running + waiting), KV usage, and whether
    admission is paused by the KV watermark."""

    replica: str
    num_requests: int = 0
    kv_usage: float = 0.0
    watermark_alert: bool = False

    @classmethod
    def from_routing_stats(cls, replica: str, stats: Mapping[str, Any] | None,
                           outstanding: int = 0) -> ReplicaLoad:
        """The router's view of a replica: its last :func:`routing_stats` (None or empty
        before the first report) and the requests this router has outstanding on it (exact
        and immediate; the replica's count also covers other routers): the larger counts."""
        stats = stats or {}
        return cls(replica, max(outstanding, int(stats.get("num_requests", 0))),
                   float(stats.get("kv_usage", 0.0)), bool(stats.get("watermark_alert", False)))


def routing_stats(stats: EngineStats) -> dict[str, Any]:
    """What a replica reports to the request routers (Ray Serve's ``record_routing_stats``,
    plain data): load and KV pressure from the engine's stats snapshot, and its pool size
    (the bound of the router's :class:`PrefixIndex` for it)."""
    return {"num_requests": stats.num_running + stats.num_waiting,
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "kv_usage": stats.usage, "watermark_alert": stats.watermark_alert,
            "num_blocks": stats.num_blocks, "step": stats.step}


@dataclass(frozen=True, slots=True)
class Balance:
    """When affinity yields to load (see the module docstring for the choice)."""

    abs_requests: int
    rel: float

    @classmethod
    def from_config(cls, cluster: ClusterConfig) -> Balance:
        return cls(cluster.balance_abs_requests, cluster.balance_rel)

    def __post_init__(self) -> None:
        if self.abs_requests < 0 or self.rel < 1:
            raise ValueError("balance: abs_requests must be >= 0 and rel >= 1")

    def overloaded(self, load: int, least: int) -> bool:
        return load - least > self.abs_requests and load > self.rel * least


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen replica first, then the others as fallbacks (least loaded first).
    ``reason``: ``session`` (the session's home), ``prefix`` (cached blocks decided),
    ``hash`` (no cached blocks: the deepest block's home), ``load`` (yielded to load),
    ``kv`` (yielded to KV pressure), ``any`` (no key: the least loaded)."""

    ranked: tuple[str, ...]
    reason: str
    matched_blocks: int

    @property
    def replica(self) -> str:
        return self.ranked[0]


class PrefixIndex:
    """Per replica, the block hashes of requests routed there, LRU-bounded: an estimate of
    its prefix cache (the router does not see evictions, so entries age out by capacity)."""

    def __init__(self, capacity: int = DEFAULT_PREFIX_CAPACITY) -> None:
        self.capacity = capacity
        self._blocks: dict[str, OrderedDict[Hashable, None]] = {}

    def record(self, replica: str, block_hashes: Iterable[Hashable]) -> None:
        blocks = self._blocks.setdefault(replica, OrderedDict())
        for h in block_hashes:
            blocks[h] = None
            blocks.move_to_end(h)
        while len(blocks) > self.capacity:
            blocks.popitem(last=False)

    def match(self, replica: str, block_hashes: Sequence[Hashable]) -> int:
        """Leading blocks of the prompt believed cached on ``replica`` (hashes are chained,
        so the first miss ends the shared prefix)."""
        blocks = self._blocks.get(replica)
        if not blocks:
            return 0
        n = 0
        for h in block_hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def drop(self, replica: str) -> None:
        """Forget a replica that died: a restarted replica starts with an empty cache."""
        self._blocks.pop(replica, None)

    def replicas(self) -> list[str]:
        return list(self._blocks)

    def num_blocks(self, replica: str) -> int:
        return len(self._blocks.get(replica, ()))


def rendezvous_score(key: str, replica: str) -> int:
    """Highest-random-weight hashing: stable across processes and Python runs."""
    digest = hashlib.blake2b(f"{key}\x00{replica}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def route(keys: RouteKeys, replicas: Sequence[ReplicaLoad], index: PrefixIndex,
          balance: Balance) -> Decision:
    """Choose a replica for one request (see the module docstring)."""
    if not replicas:
        raise ValueError("route: no replica to choose from")
    matched = {r.replica: index.match(r.replica, keys.block_hashes) for r in replicas}
    by_load = sorted(replicas, key=lambda r: (r.watermark_alert, r.num_requests, r.kv_usage,
                                              r.replica))
    if keys.session_id is not None:
        key = f"s:{keys.session_id}"
        chosen = max(replicas, key=lambda r: rendezvous_score(key, r.replica))
        reason = "session"
    elif keys.block_hashes:
        key = f"b:{keys.block_hashes[-1]}"
        chosen = max(replicas, key=lambda r: (matched[r.replica],
                                              rendezvous_score(key, r.replica)))
        reason = "prefix" if matched[chosen.replica] else "hash"
    else:
        chosen, reason = by_load[0], "any"
    chosen, reason = _yield_to_load(chosen, reason, by_load, balance)
    rest = tuple(r.replica for r in by_load if r.replica != chosen.replica)
    return Decision((chosen.replica, *rest), reason, matched[chosen.replica])


def _yield_to_load(chosen: ReplicaLoad, reason: str, by_load: list[ReplicaLoad],
                   balance: Balance) -> tuple[ReplicaLoad, str]:
    least = by_load[0]
    if chosen.watermark_alert and not least.watermark_alert:
        return least, "kv"
    if balance.overloaded(chosen.num_requests, least.num_requests):
        return least, "load"
    return chosen, reason
