"""The server's sections of the YAML: ``server`` (the HTTP front end) and ``canary`` (live
requests shadowed through a reference KV dtype, :mod:`slimkv.server.canary`).

They are defined and checked here, next to the server, with the same rules and messages as
the engine's sections in :mod:`slimkv.config`, and registered there when the package is
imported (``slimkv/__init__.py``): ``Config.load`` validates them with the rest and
``config.server`` is a :class:`ServerConfig`. The engine never reads them. Plain Python:
importing the package must not import torch."""

from __future__ import annotations

from dataclasses import dataclass

from slimkv.config import (KV_DTYPES, TOOL_SECTIONS, _check, _check_choice, _check_fraction,
                           _check_int, _check_positive)


@dataclass(slots=True)
class ServerConfig:
    """HTTP front end. ``drain_timeout_s``: on SIGTERM (or a cluster replica's shutdown)
    running streams get this long to finish before they end cleanly
    (:mod:`slimkv.server.drain`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    max_body_bytes: int = 4 * 1024 * 1024
    max_n: int = 8  # the most choices (``n``) one request may ask for
    drain_timeout_s: float = 20.0

    def __post_init__(self) -> None:
        _check(isinstance(self.port, int) and 0 <= self.port < 65536,
               "server.port", f"must be a TCP port number, got {self.port!r}")
        for key in ("max_body_bytes", "max_n"):
            _check_int(getattr(self, key), f"server.{key}")
        _check_positive(self.drain_timeout_s, "server.drain_timeout_s", inclusive=True)


@dataclass(slots=True)
class CanaryConfig:
    """Shadow a fraction of live requests through a reference KV dtype."""

    fraction: float = 0.0
    reference_dtype: str = "float32"
    memory_gb: float = 0.25
    max_pending: int = 4

    def __post_init__(self) -> None:
        _check_fraction(self.fraction, "canary.fraction", allow_zero=True)
        _check_choice(self.reference_dtype, KV_DTYPES, "canary.reference_dtype")
        _check_positive(self.memory_gb, "canary.memory_gb")
        _check_int(self.max_pending, "canary.max_pending")


TOOL_SECTIONS.update(server=ServerConfig, canary=CanaryConfig)
