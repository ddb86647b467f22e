"""Shared fixtures. Server fixtures: a real slimkv server (uvicorn in a background thread)
on a free local port; one int8 server is shared by the whole session.

The server's packages (uvicorn, httpx, prometheus_client) are imported where they are used,
not here: the GPU image that scripts/cuda_check.sh runs on has none of them, and its tests
(tests/test_cuda.py, tests/test_triton_*.py) must still collect there."""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pytest
import torch

from slimkv.config import Config
from slimkv.engine.engine_stats import EngineStats, LaneCounts

if TYPE_CHECKING:
    import httpx

# Triton reads TRITON_INTERPRET when it is first imported: on a machine without CUDA every
# test runs its kernels on CPU tensors under the interpreter (tests/test_triton_*.py). On a
# GPU the CUDA tests need the compiled kernels, so it is left unset there.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

API_KEY = "test-key"


@pytest.fixture
def fused_kernel() -> None:
    """Skip a test that needs the fused C decode kernel where it cannot be built (no C
    compiler): the engine then decodes on SDPA and reports why, which is not a failure."""
    from slimkv.backends.cpu_decode import kernel_unavailable_reason

    reason = kernel_unavailable_reason()
    if reason is not None:
        pytest.skip(f"no fused decode kernel here: {reason}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    url: str
    api_key: str | None
    model: str

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def openai(self):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "none",
                             max_retries=0, timeout=120)

    def http(self) -> httpx.Client:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=120)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of /metrics, e.g. ``metric("slimkv:kv_cache_blocks_used")``."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and labels.items() <= sample.labels.items():
                    return sample.value
        raise KeyError(f"{name}{labels or ''} not in /metrics")

    def wait_for_metric(self, name: str, want: float, timeout: float = 30.0) -> float:
        deadline = time.monotonic() + timeout
        while (value := self.metric(name)) != want and time.monotonic() < deadline:
            time.sleep(0.05)
        return value


@contextmanager
def live_server(config: Config) -> Iterator[LiveServer]:
    from slimkv.server.app import build_app

    port = free_port()
    config = config.replace("server", port=port)
    app = build_app(config)
    with serve_app(app, port) as url:
        yield LiveServer(url, config.server.api_key, app.state.model_name)


@contextmanager
def serve_app(app, port: int | None = None) -> Iterator[str]:
    """Run an ASGI app under uvicorn in a background thread; yields its base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def small_config(**sections: dict) -> Config:
    """The embedded default config (int8 KV) with a small KV pool and float32 weights (the
    precision the numerical tests are written for), plus overrides."""
    config = Config.load().replace("kv_cache", num_blocks=256).replace("model", dtype="float32")
    for section, changes in sections.items():
        config = config.replace(section, **changes)
    return config


def engine_stats(**changes) -> EngineStats:
    """An idle engine's stats snapshot (10 free blocks of 16 tokens), plus ``changes``."""
    base = EngineStats(
        model_name="m", k_dtype="int8", v_dtype="int8", bytes_per_token=12420, block_size=16,
        num_blocks=10, memory={"weights": 1}, watermark=0.7, evict_policy="lru_block",
        max_concurrency_soft=48, step=0, num_running=0, num_waiting=0,
        lanes={"fast": LaneCounts(0, 0), "slow": LaneCounts(0, 0)}, num_free_blocks=10,
        watermark_alert=False, prefix_queries=0, prefix_hits=0, preemptions=0, evictions=0,
        false_ooms=0)
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="session")
def server() -> Iterator[LiveServer]:
    """The default int8 server, with an API key (so every test also exercises auth)."""
    with live_server(small_config(server={"api_key": API_KEY})) as live:
        yield live


@pytest.fixture(scope="session")
def hf_reference() -> torch.nn.Module:
    """transformers' float32 model from the embedded GGUF, the independent reference that
    tests/test_model.py, test_engine.py and test_engine_options.py compare with. Loaded
    once per session (~10 s each time); tests must not change it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from slimkv.model_io import default_model_path

    path = default_model_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
