"""A ``slimkv serve`` subprocess on a free loopback port, and a sampler of its /metrics.

The capacity bench runs each KV variant in its own server process, as an operator would,
so the load generator and the engine do not share an interpreter.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from slimkv.config import Config

SAMPLE_EVERY_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """``with ServerProcess(config) as server:`` serves ``config`` until the block ends."""

    def __init__(self, config: Config, start_timeout: float = 180.0) -> None:
        self.port = free_port()
        self.config = config.replace("server", host="127.0.0.1", port=self.port, api_key=None)
        self.url = f"http://127.0.0.1:{self.port}"
        self.start_timeout = start_timeout
        self._dir = tempfile.TemporaryDirectory(prefix="slimkv-capacity-")
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        path = Path(self._dir.name) / "config.yaml"
        path.write_text(yaml.safe_dump(self.config.to_dict()))
        self._log = open(Path(self._dir.name) / "server.log", "wb")
        self._proc = subprocess.Popen([sys.executable, "-m", "slimkv.cli", "serve", "--config",
                                       str(path)], stdout=self._log, stderr=subprocess.STDOUT)
        self._wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        self._log.close()
        self._dir.cleanup()

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def model_name(self) -> str:
        return httpx.get(f"{self.url}/v1/models", timeout=10).json()["data"][0]["id"]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                log = (Path(self._dir.name) / "server.log").read_text(errors="replace")
                raise RuntimeError(f"the server exited with {self._proc.returncode}:\n{log[-2000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the server did not start within {self.start_timeout:g} s")


def scrape(text: str) -> dict[str, float | dict[str, str]]:
    """Each sample's value by name (the last of a labelled family); ``*_info`` samples
    keep their labels instead."""
    values: dict[str, float | dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            values[sample.name] = sample.labels if sample.name.endswith("_info") else sample.value
    return values


@dataclass(slots=True)
class ServerLoad:
    """What the server itself saw while one concurrency level ran."""

    samples: int = 0
    peak_running: int = 0
    running_sum: float = 0.0
    peak_waiting: int = 0
    peak_blocks_used: int = 0
    blocks_total: int = 0
    bytes_per_token: int = 0
    block_size: int = 0
    preemptions_start: float | None = None
    preemptions: int = 0
    # prefix-cache counters (prompt tokens looked up, found) at the first and last sample
    prefix_start: tuple[float, float] | None = None
    prefix_end: tuple[float, float] = (0.0, 0.0)

    def add(self, m: dict) -> None:
        running = int(m["slimkv:num_requests_running"])
        self.samples += 1
        self.running_sum += running
        self.peak_running = max(self.peak_running, running)
        self.peak_waiting = max(self.peak_waiting, int(m["slimkv:num_requests_waiting"]))
        self.peak_blocks_used = max(self.peak_blocks_used, int(m["slimkv:kv_cache_blocks_used"]))
        self.blocks_total = int(m["slimkv:kv_cache_blocks_total"])
        info = m["slimkv:kv_cache_dtype_info"]
        self.bytes_per_token, self.block_size = int(info["bytes_per_token"]), int(info["block_size"])
        total = m["slimkv:num_preemptions_total"]
        if self.preemptions_start is None:
            self.preemptions_start = total
        self.preemptions = int(total - self.preemptions_start)
        self.prefix_end = (m["slimkv:prefix_cache_queries_total"],
                           m["slimkv:prefix_cache_hits_total"])
        if self.prefix_start is None:
            self.prefix_start = self.prefix_end

    def summary(self) -> dict[str, float | int]:
        block_bytes = self.bytes_per_token * self.block_size
        return {"peak_running": self.peak_running,
                "mean_running": round(self.running_sum / max(1, self.samples), 2),
                "peak_waiting": self.peak_waiting, "preemptions": self.preemptions,
                "peak_kv_blocks_used": self.peak_blocks_used, "kv_blocks_total": self.blocks_total,
                "peak_kv_bytes_used": self.peak_blocks_used * block_bytes,
                "kv_pool_bytes": self.blocks_total * block_bytes,
                "prefix_hit_rate": self.prefix_hit_rate}

    @property
    def prefix_hit_rate(self) -> float | None:
        """Prompt tokens found in the prefix cache / looked up, between the first and last
        sample (None: no lookup)."""
        queries, hits = (end - start for end, start in zip(self.prefix_end,
                                                           self.prefix_start or (0.0, 0.0)))
        return round(hits / queries, 4) if queries else None


async def sample_metrics(url: str, load: ServerLoad, stop: asyncio.Event) -> None:
    """Scrape ``/metrics`` every ``SAMPLE_EVERY_S`` into ``load`` until ``stop`` is set."""
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            try:
                load.add(scrape((await http.get(f"{url}/metrics")).text))
            except httpx.HTTPError:
                pass
            try:
                await asyncio.wait_for(stop.wait(), SAMPLE_EVERY_S)
                return
            except asyncio.TimeoutError:
                continue
