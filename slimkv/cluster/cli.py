"""``slimkv serve --replicas N``: deploy on Ray Serve and stay up until interrupted."""

from __future__ import annotations

import signal
import threading

from slimkv.config import Config


def serve_cluster(config: Config) -> int:
    from slimkv.cluster.launch import deploy, shutdown

    cluster = config.cluster
    where = cluster.ray_address or "a local Ray cluster"
    print(f"slimkv: starting {cluster.replicas} engine replica(s) on {where} "
          f"(router: {cluster.router})", flush=True)
    url = deploy(config)
    print(f"slimkv: serving on {url}\n  OpenAI clients: base_url={url}/v1"
          f"{'  (api_key required)' if config.server.api_key else ''}\n"
          f"  metrics (every replica, label 'replica'): {url}/metrics\n"
          f"  dashboard (one block map per replica): {url}/dashboard", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    shutdown()
    return 0
