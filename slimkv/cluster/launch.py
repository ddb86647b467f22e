"""Start or join a Ray cluster and deploy the slimkv application on Ray Serve: one HTTP
ingress (``server.host``/``port``) and ``cluster.replicas`` engine replicas routed by
``cluster.router``.

A local cluster gets explicit ``num_cpus`` and a small object store (the replicas exchange
token ids and outputs, never tensors), so it fits a small machine; on a real cluster pass
``cluster.ray_address`` (``--ray-address``, e.g. ``auto`` on a node started with
``ray start``).
"""

from __future__ import annotations

import os
from typing import Any

import ray
from ray import serve
from ray.serve.config import HTTPOptions, RequestRouterConfig

from slimkv.cluster.ingress import Ingress
from slimkv.cluster.policy import Balance
from slimkv.cluster.replica import EngineReplica
from slimkv.cluster.router import ROUTER_CLASSES, router_kwargs
from slimkv.config import Config

APP_NAME = "slimkv"
NAMESPACE = "slimkv"
SHUTDOWN_MARGIN_S = 10.0  # past the drain: the replica's last chunks reach the KV tier


def start_ray(config: Config) -> None:
    """``ray.init`` for ``config.cluster`` (a no-op when Ray is already up)."""
    if ray.is_initialized():
        return
    cluster = config.cluster
    if cluster.ray_address:
        ray.init(address=cluster.ray_address, namespace=NAMESPACE, log_to_driver=False)
    else:
        ray.init(num_cpus=cluster.num_cpus or os.cpu_count(),
                 object_store_memory=cluster.object_store_mb * 1024 * 1024,
                 include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)


def application(config: Config) -> serve.Application:
    """The bound application: ingress -> engine replicas."""
    cluster = config.cluster
    router = RequestRouterConfig(
        request_router_class=ROUTER_CLASSES[cluster.router],
        request_router_kwargs=router_kwargs(cluster.router, Balance.from_config(cluster)),
        request_routing_stats_period_s=cluster.stats_period_s,
        request_routing_stats_timeout_s=max(cluster.stats_period_s, 5.0))
    engines = serve.deployment(EngineReplica).options(
        name="EngineReplica", num_replicas=cluster.replicas,
        max_ongoing_requests=cluster.max_ongoing_requests,
        ray_actor_options={"num_cpus": cluster.replica_num_cpus},
        request_router_config=router, health_check_period_s=2, health_check_timeout_s=30,
        graceful_shutdown_timeout_s=config.server.drain_timeout_s + SHUTDOWN_MARGIN_S)
    ingress = serve.deployment(Ingress).options(
        name="Ingress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=cluster.max_ongoing_requests * cluster.replicas)
    data = config.to_dict()
    return ingress.bind(engines.bind(data), data)


def build(args: dict[str, Any]) -> serve.Application:
    """Application builder for a Serve config file or KubeRay's ``serveConfigV2``
    (``import_path: slimkv.cluster.launch:build``): ``args`` is ``{"config": {...}}`` (the
    YAML config's sections inline) or ``{"config_path": "/etc/slimkv/config.yaml"}``."""
    if "config_path" in args:
        return application(Config.load(args["config_path"]))
    return application(Config.from_dict(args.get("config")))


def deploy(config: Config) -> str:
    """Start Ray and Serve if needed, deploy (or update) the app; returns its base URL."""
    start_ray(config)
    server = config.server
    serve.start(http_options=HTTPOptions(host=server.host, port=server.port))
    serve.run(application(config), name=APP_NAME, route_prefix="/")
    return f"http://{server.host}:{server.port}"


def shutdown() -> None:
    serve.shutdown()
    ray.shutdown()
