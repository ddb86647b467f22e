"""A ``slimkv serve`` process the soak can measure and hurt: its resident memory, SIGTERM
(a drain, with the exit status) and ``kill -9``; and what its /metrics say."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from slimkv.bench.live import ServerProcess


class SoakServer(ServerProcess):
    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.poll()

    def rss_bytes(self) -> int:
        """Resident set size of the server process now (0 once it exited)."""
        return rss_bytes(self.pid)

    def memory_mb(self) -> dict[str, float]:
        """Resident MiB by kind of mapping: ``heap`` (brk), ``anon`` (other anonymous:
        mmapped arenas and large allocations, the KV pool), ``file`` (libraries, the
        model file if mapped)."""
        out = {"heap": 0.0, "anon": 0.0, "file": 0.0}
        kind = "anon"
        try:
            with open(f"/proc/{self.pid}/smaps") as f:
                for line in f:
                    head = line.split(maxsplit=6)
                    if "-" in head[0] and len(head) >= 5:
                        name = head[5].strip() if len(head) > 5 else ""
                        kind = ("heap" if name == "[heap]" else "file" if name.startswith("/")
                                else "anon")
                    elif head[0] == "Rss:":
                        out[kind] += int(head[1]) / 1024
        except OSError:
            pass
        return {k: round(v, 1) for k, v in out.items()}

    def kill9(self) -> None:
        """``kill -9``: no drain, no atexit, the writer thread cut wherever it is."""
        os.kill(self.pid, signal.SIGKILL)
        self._proc.wait(timeout=30)

    def sigterm(self, timeout: float = 60.0) -> tuple[int | None, float]:
        """SIGTERM and wait: the exit status (None if it did not exit) and seconds taken."""
        start = time.monotonic()
        self._proc.send_signal(signal.SIGTERM)
        try:
            code = self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        return code, time.monotonic() - start

    def log_text(self) -> str:
        self._log.flush()
        with open(self._log.name, errors="replace") as f:
            return f.read()


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` now (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def metric_values(url: str, timeout: float = 30.0) -> dict[str, float]:
    """Every sample of ``url``/metrics, summed over labels except ``tier`` (kept as
    ``name{tier}``): one engine's or every replica's total."""
    text = httpx.get(f"{url}/metrics", timeout=timeout).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            name = f"{s.name}{{{s.labels['tier']}}}" if "tier" in s.labels else s.name
            out[name] = out.get(name, 0.0) + s.value
    return out
