"""``slimkv serve``: the OpenAI-compatible server on the configured model."""

from __future__ import annotations

import argparse

from slimkv.cli import add_config_args, config_from_args


def add_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with /metrics")
    add_config_args(p)
    p.add_argument("--host", help="override server.host (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, help="override server.port (default 8000)")
    p.add_argument("--api-key", help="override server.api_key: require 'Authorization: Bearer KEY'")
    p.add_argument("--replicas", type=int,
                   help="override cluster.replicas: N > 1 serves N engine replicas on Ray Serve")
    p.add_argument("--ray-address", help="override cluster.ray_address: join this Ray cluster "
                   "(e.g. 'auto' on a node started with 'ray start') instead of starting one")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from slimkv.server.app import build_app

    config = config_from_args(args)
    overrides = {k: v for k, v in (("host", args.host), ("port", args.port),
                                   ("api_key", args.api_key)) if v is not None}
    config = config.replace("server", **overrides)
    cluster = {k: v for k, v in (("replicas", args.replicas), ("ray_address", args.ray_address))
               if v is not None}
    config = config.replace("cluster", **cluster)
    if config.cluster.replicas > 1 or config.cluster.ray_address:
        from slimkv.cluster.cli import serve_cluster

        return serve_cluster(config)
    app = build_app(config)
    server = config.server
    print(f"slimkv: serving {app.state.model_name} on http://{server.host}:{server.port}\n"
          f"  OpenAI clients: base_url=http://{server.host}:{server.port}/v1"
          f"{'  (api_key required)' if server.api_key else ''}\n"
          f"  metrics: http://{server.host}:{server.port}/metrics", flush=True)
    from slimkv.server.drain import DrainingServer

    DrainingServer(uvicorn.Config(app, host=server.host, port=server.port, log_level="warning"),
                   app.state.backend, server.drain_timeout_s).run()
    return 0
