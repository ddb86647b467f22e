"""The ``cluster`` section of the YAML: engine replicas on Ray Serve (:mod:`slimkv.cluster`).

Defined and checked here, next to the cluster, with the same rules and messages as the
engine's sections in :mod:`slimkv.config`, and registered there when the package is
imported (``slimkv/__init__.py``): ``Config.load`` validates it with the rest and
``config.cluster`` is a :class:`ClusterConfig`. The engine never reads it. Plain Python (no
Ray, no torch): the package imports it."""

from __future__ import annotations

from dataclasses import dataclass

from slimkv.config import TOOL_SECTIONS, _check_choice, _check_int, _check_positive

ROUTERS = ("slimkv", "pow2")  # cluster.router: ours, or Ray Serve's power of two choices


@dataclass(slots=True)
class ClusterConfig:
    """``replicas`` > 1: engine replicas on Ray Serve behind one endpoint (slimkv/cluster/);
    ``ray_address`` None starts a local Ray (``num_cpus``: None all cores, ``object_store_mb``)
    or else joins it. ``router``, ``routing_blocks``, ``balance_*``: slimkv/cluster/policy.py."""

    replicas: int = 1
    ray_address: str | None = None
    num_cpus: int | None = None
    object_store_mb: int = 256
    replica_num_cpus: float = 1.0
    max_ongoing_requests: int = 256   # Ray's default of 5 would starve continuous batching
    router: str = "slimkv"
    routing_blocks: int = 32
    balance_abs_requests: int = 12
    balance_rel: float = 1.5
    stats_period_s: float = 1.0

    def __post_init__(self) -> None:
        for key in ("replicas", "object_store_mb", "max_ongoing_requests", "routing_blocks"):
            _check_int(getattr(self, key), f"cluster.{key}")
        _check_int(self.num_cpus, "cluster.num_cpus", optional=True)
        _check_positive(self.replica_num_cpus, "cluster.replica_num_cpus", low=0, inclusive=True)
        _check_choice(self.router, ROUTERS, "cluster.router")
        _check_int(self.balance_abs_requests, "cluster.balance_abs_requests", 0)
        _check_positive(self.balance_rel, "cluster.balance_rel", low=1, inclusive=True)
        _check_positive(self.stats_period_s, "cluster.stats_period_s")


TOOL_SECTIONS.update(cluster=ClusterConfig)
