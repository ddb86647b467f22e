"""The official ``openai`` client against a live int8 server."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def first_events(response: httpx.Response, n: int) -> list[str]:
    """Read ``n`` SSE events and keep the connection open (closing a broken-off
    ``iter_lines`` generator would close it, which the server sees as a disconnect)."""
    lines = response.iter_lines()
    response.extensions["open_lines"] = lines  # keep the generator alive with the response
    events: list[str] = []
    while len(events) < n:
        line = next(lines)
        if line.startswith("data:"):
            events.append(line)
    return events


def test_models_lists_the_served_model(server):
    models = server.openai().models.list()
    assert [m.id for m in models.data] == [server.model]


def test_int8_chat_answers_paris_with_usage(server):
    reply = server.openai().chat.completions.create(
        model=server.model, messages=FRANCE, temperature=0, max_tokens=20)
    choice = reply.choices[0]
    assert "Paris" in choice.message.content
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    usage = reply.usage
    assert usage.prompt_tokens > 5 and 0 < usage.completion_tokens <= 20
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completion_stops_at_max_tokens(server):
    reply = server.openai().completions.create(
        model=server.model, prompt="Once upon a time", max_tokens=5, temperature=0)
    assert reply.choices[0].text.strip()
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


def test_streamed_chat_equals_the_unstreamed_reply(server):
    client = server.openai()
    kwargs = dict(model=server.model, messages=FRANCE, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole and "Paris" in text
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_streamed_completion(server):
    stream = server.openai().completions.create(
        model=server.model, prompt="The sky is", max_tokens=6, temperature=0, stream=True)
    chunks = list(stream)
    assert len(chunks) == 6  # one token per chunk here: plain English text
    assert "".join(c.choices[0].text for c in chunks).strip()
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_string_is_honoured(server):
    reply = server.openai().chat.completions.create(
        model=server.model, messages=FRANCE, temperature=0, max_tokens=20, stop=["Paris"])
    assert reply.choices[0].finish_reason == "stop"
    assert "Paris" not in reply.choices[0].message.content


def test_eight_concurrent_requests_all_answer(server):
    client = server.openai()
    topics = ["cats", "the sea", "Rome", "music", "rain", "trees", "bread", "stars"]

    def ask(topic: str) -> tuple[str, int]:
        reply = client.chat.completions.create(
            model=server.model, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": f"Write one sentence about {topic}."}])
        return reply.choices[0].message.content, reply.usage.completion_tokens

    generated_before = server.metric("slimkv:generation_tokens_total")
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(ask, topics))
    assert all(text.strip() for text, _ in results)
    assert all(0 < n <= 8 for _, n in results)
    generated = server.metric("slimkv:generation_tokens_total") - generated_before
    assert generated == sum(n for _, n in results)


def test_client_disconnect_mid_stream_frees_blocks(server):
    idle = server.wait_for_metric("slimkv:num_requests_running", 0)
    assert idle == 0
    idle_blocks = server.metric("slimkv:kv_cache_blocks_used")
    aborts = server.metric("slimkv:request_success_total", finished_reason="abort")
    body = {"model": server.model, "prompt": "Count: one, two, three,", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        first_events(response, 3)
        assert server.metric("slimkv:kv_cache_blocks_used") > idle_blocks
    # the connection is closed here, long before 2000 tokens
    assert server.wait_for_metric("slimkv:kv_cache_blocks_used", idle_blocks) == idle_blocks
    assert server.metric("slimkv:num_requests_running") == 0
    assert server.metric("slimkv:request_success_total", finished_reason="abort") == aborts + 1


def test_requests_arriving_later_join_the_running_batch(server):
    """A short request sent while a long one streams finishes first."""
    body = {"model": server.model, "prompt": "Tell me a story.", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    with server.http() as http, http.stream("POST", "/v1/completions", json=body) as long:
        first_events(long, 1)
        short = httpx.post(f"{server.base_url}/completions", timeout=60,
                           headers={"Authorization": f"Bearer {server.api_key}"},
                           json={"model": server.model, "prompt": "Hi", "max_tokens": 2})
        assert short.status_code == 200
        assert server.metric("slimkv:num_requests_running") == 1  # the long one still runs


@pytest.mark.parametrize("stream", [False, True])
def test_client_giving_up_while_queued_aborts_its_request(stream):
    """With one running slot taken, a second request queues; its client times out and
    leaves, and the server drops it from the queue long before the slot frees up."""
    from conftest import live_server, small_config

    with live_server(small_config(kv_cache={"max_concurrency_soft": 1})) as server:
        long_body = {"model": server.model, "prompt": "Count: one, two,", "max_tokens": 1500,
                     "ignore_eos": True, "stream": True}
        with server.http() as http, http.stream("POST", "/v1/completions", json=long_body) as busy:
            first_events(busy, 2)
            queued = {"model": server.model, "prompt": "Hi", "max_tokens": 4, "stream": stream}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{server.url}/v1/completions", json=queued, timeout=1.0)
            assert server.wait_for_metric("slimkv:num_requests_waiting", 0, timeout=10) == 0
            assert server.metric("slimkv:request_success_total", finished_reason="abort") == 1
            assert server.metric("slimkv:num_requests_running") == 1   # the long one still runs
