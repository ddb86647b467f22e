"""Two engine replicas on a real local Ray cluster behind one OpenAI endpoint (Ray Serve).

One module-scoped cluster (about 50 s to start on 2 cores: Ray, Serve, two model loads),
its replicas sharing one disk KV tier (a temporary directory); the replica-kill test runs
last because Serve then restarts a replica.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from conftest import API_KEY, LiveServer, free_port, small_config
from slimkv.cluster.policy import Balance, PrefixIndex, ReplicaLoad, RouteKeys, route
from slimkv.loadtest.workloads import corpus
from slimkv.server.backend import REPLICA_HEADER

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")
CHAT = "/v1/chat/completions"
TIMEOUT = httpx.Timeout(120, connect=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LiveServer]:
    from slimkv.cluster.launch import deploy, shutdown

    tier = {"host_gb": 0.0, "disk_path": str(tmp_path_factory.mktemp("kv")), "disk_gb": 1.0}
    config = small_config(server={"api_key": API_KEY, "port": free_port()},
                          kv_cache={"offload": tier},
                          cluster={"replicas": 2, "num_cpus": 2, "stats_period_s": 0.5})
    url = deploy(config)
    try:
        yield LiveServer(url, API_KEY, "SmolLM2-135M-Instruct")
    finally:
        shutdown()


def replicas(cluster: LiveServer) -> list[str]:
    with cluster.http() as http:
        return [s["replica"] for s in http.get("/v1/cache/state?blocks=false").json()["replicas"]]


def document(i: int, chars: int = 1200) -> str:
    text = corpus()
    start = (i * 7919) % (len(text) - chars)
    return f"Session {i}. Answer questions about this text.\n\n{text[start:start + chars]}"


def chat(cluster: LiveServer, messages: list[dict], **fields) -> httpx.Response:
    body = {"model": cluster.model, "messages": messages, "max_tokens": 8, "temperature": 0,
            **fields}
    with cluster.http() as http:
        return http.post(CHAT, json=body, timeout=TIMEOUT)


def home(names: list[str], session: str) -> str:
    """Where the routing policy, run here as a pure function, sends a fresh session."""
    balance = Balance.from_config(small_config().cluster)
    return route(RouteKeys(session), [ReplicaLoad(n) for n in names], PrefixIndex(),
                 balance).replica


def test_each_response_names_its_replica(cluster):
    names = replicas(cluster)
    assert len(names) == 2
    r = chat(cluster, [{"role": "user", "content": "Hi"}])
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] in names
    body = {"model": cluster.model, "prompt": "The sky is", "max_tokens": 3, "stream": True}
    with cluster.http() as http, http.stream("POST", "/v1/completions", json=body) as s:
        lines = [line for line in s.iter_lines() if line]
    assert s.status_code == 200 and s.headers[REPLICA_HEADER] in names
    assert lines[-1] == "data: [DONE]" and len(lines) == 4


def test_twenty_sessions_spread_as_the_policy_says(cluster):
    names = replicas(cluster)
    served = {}
    for i in range(20):
        r = chat(cluster, [{"role": "system", "content": document(i, 300)},
                           {"role": "user", "content": "Summarize."}], session_id=f"spread-{i}")
        assert r.status_code == 200, r.text
        served[f"spread-{i}"] = r.headers[REPLICA_HEADER]
    assert set(served.values()) == set(names)
    assert served == {s: home(names, s) for s in served}


def test_session_turns_stick_and_hit_the_prefix_cache_on_their_replica(cluster):
    names = replicas(cluster)
    hits = "slimkv:prefix_cache_hits_total"
    messages = [{"role": "system", "content": document(100)},
                {"role": "user", "content": "What is this text about?"}]
    first = chat(cluster, messages, session_id="sticky")
    sticky = first.headers[REPLICA_HEADER]
    before = {n: cluster.metric(hits, replica=n) for n in names}
    cached = []
    for turn, question in enumerate(("Name one fact in it.", "And another one?"), start=2):
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": question}]
        with cluster.http() as http:  # the session as a header this time
            first = http.post(CHAT, json={"model": cluster.model, "messages": messages,
                                          "max_tokens": 8, "temperature": 0},
                              headers={"X-Session-ID": "sticky"}, timeout=TIMEOUT)
        assert first.status_code == 200 and first.headers[REPLICA_HEADER] == sticky, turn
        cached.append(first.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert min(cached) >= 256  # the document's blocks came from the prefix cache
    after = {n: cluster.metric(hits, replica=n) for n in names}
    assert after[sticky] - before[sticky] == sum(cached)
    assert all(after[n] == before[n] for n in names if n != sticky)


def test_bad_input_gets_the_same_4xx_as_the_single_engine_server(cluster, server):
    long_prompt = "word " * 9000
    cases = [
        {"content": b'{"model": "x", "messages": ['},
        {"content": b'{"model": "\xff\xfe"}'},
        {"json": [1, 2]},
        {"json": {"model": cluster.model, "messages": []}},
        {"json": {"model": cluster.model, "messages": [{"role": "user", "content": "hi"}],
                  "max_tokens": -5}},
        {"json": {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}},
        {"json": {"model": cluster.model, "messages": [{"role": "user", "content": long_prompt}]}},
        {"json": {"model": cluster.model, "messages": [{"role": "user", "content": "hi"}]},
         "headers": {"Authorization": "Bearer wrong"}},
        {"content": b"x" * (5 * 1024 * 1024)},
    ]

    def answer(live: LiveServer, case: dict) -> tuple:
        with live.http() as http:
            r = http.post(CHAT, timeout=TIMEOUT, **case)
        error = r.json()["error"]
        return r.status_code, error["code"], error["param"], error["type"]

    for case in cases:
        got, want = answer(cluster, case), answer(server, case)
        assert got == want and 400 <= got[0] < 500, (case.keys(), got, want)
    with cluster.http() as http:
        assert http.get("/v1/nowhere").status_code == 404
        assert http.get("/health").json() == {"status": "ok"}


def test_a_client_disconnect_frees_the_blocks_on_its_replica(cluster):
    blocks = "slimkv:kv_cache_blocks_used"
    aborts = ("slimkv:request_success_total", {"finished_reason": "abort"})
    body = {"model": cluster.model, "messages": [{"role": "user", "content": document(7)}],
            "max_tokens": 400, "ignore_eos": True, "stream": True, "session_id": "leaver"}
    names = replicas(cluster)
    target = home(names, "leaver")
    aborted = cluster.metric(aborts[0], replica=target, **aborts[1])
    with cluster.http() as http, http.stream("POST", CHAT, json=body, timeout=TIMEOUT) as s:
        assert s.headers[REPLICA_HEADER] == target
        lines = s.iter_lines()
        next(lines), next(lines)
        assert cluster.metric(blocks, replica=target) > 0
    deadline = time.monotonic() + 30
    while cluster.metric(blocks, replica=target) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert cluster.metric(blocks, replica=target) == 0
    assert cluster.metric(aborts[0], replica=target, **aborts[1]) == aborted + 1


def stream_events(cluster: LiveServer, session: str, max_tokens: int, first: threading.Event,
                  out: dict, messages: list[dict] | None = None) -> None:
    messages = messages or [{"role": "user", "content": document(9, 400)}]
    body = {"model": cluster.model, "messages": messages,
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True, "session_id": session}
    with cluster.http() as http, http.stream("POST", CHAT, json=body, timeout=TIMEOUT) as s:
        out["replica"] = s.headers[REPLICA_HEADER]
        out["events"] = []
        for line in s.iter_lines():
            if line:
                out["events"].append(line)
                first.set()
    first.set()


def test_killing_a_replica_mid_stream_loses_no_session(cluster):
    names = replicas(cluster)
    victim_session = next(f"victim-{i}" for i in range(100) if home(names, f"victim-{i}") == names[0])
    other_session = next(f"other-{i}" for i in range(100) if home(names, f"other-{i}") == names[1])
    # The victim's first turn, written through to the shared tier when it finishes.
    turn1 = [{"role": "system", "content": document(31, 2400)},
             {"role": "user", "content": "What is this text about?"}]
    first = chat(cluster, turn1, session_id=victim_session)
    assert first.status_code == 200 and first.headers[REPLICA_HEADER] == names[0]
    turn2 = turn1 + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "Name one fact in it."}]
    stored = "slimkv:kv_offload_stored_blocks_total"
    deadline = time.monotonic() + 30
    while cluster.metric(stored, replica=names[0], tier="disk") < 32 and time.monotonic() < deadline:
        time.sleep(0.1)
    loaded = cluster.metric("slimkv:kv_offload_loaded_blocks_total", replica=names[1], tier="disk")
    victim, other, started = {}, {}, [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=stream_events,
                                args=(cluster, victim_session, 400, started[0], victim, turn2)),
               threading.Thread(target=stream_events, args=(cluster, other_session, 60, started[1], other))]
    for t in threads:
        t.start()
    assert all(e.wait(60) for e in started)
    ray.kill(ray.get_actor(f"SERVE_REPLICA::slimkv#EngineReplica#{names[0]}", namespace="serve"))
    for t in threads:
        t.join(120)
        assert not t.is_alive(), "a stream hung after the kill"
    assert victim["replica"] == names[0] and other["replica"] == names[1]
    error = json.loads(victim["events"][-2].removeprefix("data: "))["error"]
    assert error["code"] == "replica_unavailable" and victim["events"][-1] == "data: [DONE]"
    assert other["events"][-1] == "data: [DONE]"
    assert not any('"error"' in e for e in other["events"])
    # The session's turn is answered again, re-routed: its history comes from the shared
    # tier, where the dead replica wrote it (the other replica never saw this session).
    r = chat(cluster, turn2, session_id=victim_session)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] == names[1]
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 512
    assert cluster.metric("slimkv:kv_offload_loaded_blocks_total", replica=names[1],
                          tier="disk") >= loaded + 32
    # Serve replaces the dead replica.
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = replicas(cluster)
        if len(now) == 2 and names[0] not in now:
            break
        time.sleep(1)
    assert len(now) == 2 and names[1] in now and names[0] not in now
    r = chat(cluster, [{"role": "user", "content": "Hi"}], session_id=other_session)
    assert r.status_code == 200 and r.headers[REPLICA_HEADER] in now


def test_echo_tokenize_and_template_controls_through_the_ingress(cluster, server):
    """Issue 45's fields answer as on the single-engine server, prompt logprobs (scored
    on the replica, sent back before the first output) included."""
    body = {"model": cluster.model, "prompt": ["The sky is", "Grass is"], "max_tokens": 3,
            "temperature": 0, "echo": True}
    with cluster.http() as http, server.http() as single:
        got, want = (h.post("/v1/completions", json=body, timeout=TIMEOUT) for h in (http, single))
        assert got.status_code == 200, got.text
        assert [c["text"] for c in got.json()["choices"]] == [
            c["text"] for c in want.json()["choices"]]
        scored = {**body, "logprobs": 1, "prompt_logprobs": 2}
        got, want = (h.post("/v1/completions", json=scored, timeout=TIMEOUT)
                     for h in (http, single))
        assert got.status_code == 200, got.text
        for mine, theirs in zip(got.json()["choices"], want.json()["choices"]):
            assert mine["prompt_logprobs"] == theirs["prompt_logprobs"]  # the same score()
            n = len(mine["prompt_logprobs"])
            assert mine["logprobs"]["token_logprobs"][:n] == theirs["logprobs"]["token_logprobs"][:n]
            assert mine["text"] == theirs["text"]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "add_generation_prompt": False}
        got, want = (h.post("/tokenize", json=chat, timeout=TIMEOUT) for h in (http, single))
        assert got.status_code == 200 and got.json() == want.json()
