"""A graceful drain and a crash while the disk tier writes, on real ``slimkv serve``
processes over one directory (started together, to save time).

1. Server 1 (``write: evict``: chunks stay in the pool) answers session B's first turn,
   then gets SIGTERM while B's second turn streams: the stream ends with an SSE error
   event and ``[DONE]``, the server exits 0 in time, and B's chunks are now on disk.
2. Server 2 (``write: through``, disk only) answers session A's first turn, then takes
   long prompts that keep its writer busy, and is killed with ``kill -9``.
3. The directory holds no bad chunk (an audit of every file). Server 3 (in this process)
   starts over it: nothing corrupt found, the dead writer's temporary file removed, and A
   and B continue with their KV loaded from disk, answering exactly what a clean run (the
   shared in-process server, never drained nor crashed) answers.
"""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from conftest import live_server, small_config
from slimkv.bench.chunk_audit import audit_chunks
from slimkv.bench.soak_server import SoakServer, metric_values
from slimkv.loadtest.workloads import corpus

pytestmark = pytest.mark.slow
CHAT = "/v1/chat/completions"
DRAIN_S = 2.0


def document(i: int, chars: int) -> str:
    text = corpus()
    start = (i * 3571) % (len(text) - chars)
    return f"Document {i}.\n\n{text[start:start + chars]}"


def ask(url: str, messages: list[dict], api_key: str | None = None, **fields) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 8,
            "temperature": 0, **fields}
    r = httpx.post(f"{url}{CHAT}", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def second(first: list[dict], answer: str) -> list[dict]:
    return first + [{"role": "assistant", "content": answer},
                    {"role": "user", "content": "Name one detail."}]


def offload(path, **changes) -> dict:
    return {"host_gb": 0.0, "disk_path": str(path), "disk_gb": 1.0, **changes}


def keep_writing(url: str, stop: threading.Event) -> None:
    i = 100
    while not stop.is_set() and i < 140:
        try:
            ask(url, [{"role": "user", "content": document(i, 4000)}], max_tokens=1)
        except (httpx.HTTPError, AssertionError):
            return
        i += 1


def drained_stream(server: SoakServer, messages: list[dict]) -> tuple[list[str], dict]:
    """Stream a long answer and SIGTERM the server once it has begun: the events and
    ``{"code": exit status, "s": seconds to exit}``."""
    body = {"model": "SmolLM2-135M-Instruct", "messages": messages, "max_tokens": 400,
            "ignore_eos": True, "temperature": 0, "stream": True}
    events, exit_info, killer = [], {}, None
    with httpx.stream("POST", f"{server.url}{CHAT}", json=body, timeout=120) as s:
        assert s.status_code == 200
        for line in s.iter_lines():
            if line.startswith("data:"):
                events.append(line.removeprefix("data: "))
            if len(events) == 2 and killer is None:
                killer = threading.Thread(target=lambda: exit_info.update(
                    zip(("code", "s"), server.sigterm(DRAIN_S + 30))))
                killer.start()
    killer.join(60)
    return events, exit_info


def test_a_drain_and_a_crash_mid_write_lose_no_session(tmp_path, server) -> None:
    a1 = [{"role": "system", "content": document(1, 2600)},
          {"role": "user", "content": "Summarize it."}]
    b1 = [{"role": "system", "content": document(2, 2600)},
          {"role": "user", "content": "Summarize it."}]
    drain = small_config(kv_cache={"offload": offload(tmp_path, host_gb=0.05)},
                         server={"drain_timeout_s": DRAIN_S})
    crash = small_config(kv_cache={"offload": offload(tmp_path, write="through")})
    servers = [SoakServer(drain, start_timeout=300), SoakServer(crash, start_timeout=300)]
    with ThreadPoolExecutor(2) as pool, ExitStack() as stack:
        starting = [pool.submit(stack.enter_context, s) for s in servers]
        ref = {}     # the clean run: the shared server, never crashed nor drained
        for name, first in (("a", a1), ("b", b1)):
            ref[f"{name}1"] = ask(server.url, first, server.api_key)["choices"][0]["message"]["content"]
            ref[f"{name}2"] = ask(server.url, second(first, ref[f"{name}1"]),
                                  server.api_key)["choices"][0]["message"]["content"]
        p1, p2 = (f.result() for f in starting)
        # Drain: B's chunks stay in server 1's pool (write: evict) until SIGTERM.
        assert ask(p1.url, b1)["choices"][0]["message"]["content"] == ref["b1"]
        files_before = {p.name for p in tmp_path.glob("*.kv")}
        events, exit_info = drained_stream(p1, second(b1, ref["b1"]))
        assert events[-1] == "[DONE]" and len(events) >= 4
        assert json.loads(events[-2])["error"]["code"] == "shutting_down"
        assert exit_info["code"] == 0 and exit_info["s"] < DRAIN_S + 15
        assert len({p.name for p in tmp_path.glob("*.kv")} - files_before) >= 3
        # Crash: server 2 writes every finished turn through, and dies mid-write.
        assert ask(p2.url, a1)["choices"][0]["message"]["content"] == ref["a1"]
        stop = threading.Event()
        writers = [threading.Thread(target=keep_writing, args=(p2.url, stop)) for _ in range(2)]
        for t in writers:
            t.start()
        stored = "slimkv:kv_offload_stored_blocks_total{disk}"
        base, deadline = metric_values(p2.url)[stored], time.monotonic() + 60
        while metric_values(p2.url)[stored] < base + 32 and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 10      # aim the kill at a write in flight
        while not list(tmp_path.glob("*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.001)
        p2.kill9()
        stop.set()
        for t in writers:
            t.join(60)
    audit = audit_chunks(str(tmp_path))
    assert audit.bad == 0 and audit.chunks >= 6
    # A restart over the directory: no bad chunk loaded, both sessions go on with their KV.
    with live_server(drain) as p3:
        assert p3.metric("slimkv:kv_offload_corrupt_blocks_total", tier="disk") == 0
        assert not list(tmp_path.glob("*.tmp"))           # the dead writer's, removed
        for name, first in (("a", a1), ("b", b1)):
            reply = ask(p3.url, second(first, ref[f"{name}1"]))
            assert reply["choices"][0]["message"]["content"] == ref[f"{name}2"], name
            assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512, name
        assert p3.metric("slimkv:kv_offload_loaded_blocks_total", tier="disk") >= 64
