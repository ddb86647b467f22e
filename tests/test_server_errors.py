"""Bad input gets an OpenAI-style JSON error with a 4xx status, never a 500 or a hang."""

from __future__ import annotations

import threading

import httpx
import pytest

from conftest import live_server, small_config

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


def chat(model: str, **fields) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            **fields}


def assert_error(response: httpx.Response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["message"] and error["type"]
    return error


def test_malformed_json_is_400(server):
    with server.http() as http:
        r = http.post(CHAT, content=b'{"model": "x", "messages": [', headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")


def test_non_utf8_body_is_400(server):
    with server.http() as http:
        r = http.post(CHAT, content=b'{"model": "\xff\xfe"}')
    assert_error(r, 400, "invalid_encoding")


def test_json_that_is_not_an_object_is_400(server):
    with server.http() as http:
        assert_error(http.post(CHAT, json=[1, 2]), 400, "invalid_json")


@pytest.mark.parametrize("fields, param", [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ({"max_tokens": -5}, "max_tokens"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": 7}, "temperature"),
    ({"n": 0}, "n"),
])
def test_invalid_fields_are_422_naming_the_field(server, fields, param):
    body = chat(server.model, **fields)
    body = {k: v for k, v in body.items() if v is not None}
    with server.http() as http:
        error = assert_error(http.post(CHAT, json=body), 422, "invalid_value")
    assert error["param"] == param


def test_missing_model_is_422(server):
    with server.http() as http:
        r = http.post("/v1/completions", json={"prompt": "Hi"})
    assert assert_error(r, 422, "invalid_value")["param"] == "model"


def test_absurd_max_tokens_is_400(server):
    with server.http() as http:
        r = http.post(CHAT, json=chat(server.model, max_tokens=10**9))
    assert "maximum context length" in assert_error(r, 400, "invalid_prompt")["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_context_is_400(server, stream):
    body = {"model": server.model, "prompt": "word " * 9000, "max_tokens": 1, "stream": stream}
    with server.http() as http:
        r = http.post("/v1/completions", json=body)
    assert "maximum context length" in assert_error(r, 400, "invalid_prompt")["message"]


def test_unknown_model_is_404(server):
    with server.http() as http:
        error = assert_error(http.post(CHAT, json=chat("gpt-9")), 404, "model_not_found")
    assert server.model in error["message"]


def test_unknown_route_is_404_in_openai_shape(server):
    with server.http() as http:
        assert_error(http.get("/v1/nothing"), 404, "not_found")


@pytest.mark.parametrize("chunked", [False, True])
def test_oversized_body_is_413(server, chunked):
    big = b'{"model": "' + b"x" * (5 * 1024 * 1024) + b'"}'
    content = iter([big[i:i + 65536] for i in range(0, len(big), 65536)]) if chunked else big
    with server.http() as http:
        assert_error(http.post(CHAT, content=content), 413, "request_too_large")


@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Basic test-key"])
def test_api_key_is_required_on_the_api(server, auth):
    headers = {"Authorization": auth} if auth else {}
    r = httpx.post(f"{server.base_url}/chat/completions", json=chat(server.model), headers=headers)
    assert_error(r, 401, "invalid_api_key")
    assert httpx.get(f"{server.base_url}/models", headers=headers).status_code == 401


def test_health_and_metrics_stay_open(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert "slimkv:num_requests_running" in httpx.get(f"{server.url}/metrics").text


@pytest.fixture(scope="module")
def busy_server():
    """One request runs at a time; one may wait, for at most 2 s."""
    config = small_config(kv_cache={"max_concurrency_soft": 1},
                          scheduler={"max_queue": 1, "queue_timeout_s": 2.0})
    with live_server(config) as live:
        yield live


def test_full_queue_and_queue_timeout_are_429_with_retry_after(busy_server):
    s = busy_server
    long_body = {"model": s.model, "prompt": "Go on:", "max_tokens": 2000, "ignore_eos": True,
                 "stream": True}
    queued: list[httpx.Response] = []
    with s.http() as http, http.stream("POST", "/v1/completions", json=long_body) as long:
        assert long.status_code == 200
        waiter = threading.Thread(target=lambda: queued.append(
            httpx.post(f"{s.base_url}/completions", json={"model": s.model, "prompt": "Hi"},
                       timeout=60)))
        waiter.start()
        assert s.wait_for_metric("slimkv:num_requests_waiting", 1) == 1
        r = httpx.post(f"{s.base_url}/completions", json={"model": s.model, "prompt": "Hi"})
        assert_error(r, 429, "server_busy")
        assert r.headers["Retry-After"] == "1"
        waiter.join(timeout=30)  # the long request still runs: the queued one times out
        assert "queue_timeout_s" in assert_error(queued[0], 429, "server_busy")["message"]
