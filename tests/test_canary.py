"""The live canary: shadowed requests, its metrics, and that clients never see it."""

import pytest

from conftest import live_server, small_config

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Name a primary colour.", "What is 2 + 2?"]


def ask(server, question: str) -> str:
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={
            "model": server.model, "temperature": 0, "max_tokens": 16,
            "messages": [{"role": "user", "content": question}]})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_canary_agrees_fully_when_serving_the_reference_dtype():
    config = small_config(kv_cache={"dtype": "float32"},
                          canary={"fraction": 1.0, "reference_dtype": "float32",
                                  "memory_gb": 0.05})
    with live_server(config) as server:
        answers = [ask(server, q) for q in QUESTIONS]
        assert server.wait_for_metric("slimkv:canary_requests_total", 3, timeout=120) == 3
        count = server.metric("slimkv:canary_token_agreement_count")
        total = server.metric("slimkv:canary_token_agreement_sum")
        assert count == 3 and total == pytest.approx(3.0)
        assert server.metric("slimkv:canary_logprob_delta_sum") == pytest.approx(0.0)
        assert server.metric("slimkv:canary_dropped_total") == 0
        assert server.metric("slimkv:canary_diverged_requests_total") == 0
        assert "Paris" in answers[0]


def test_canary_is_off_by_default(server):
    with pytest.raises(KeyError):
        server.metric("slimkv:canary_requests_total")
