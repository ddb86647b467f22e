"""OpenAI options over HTTP, in OpenAI's exact shapes: logprobs (chat and completions,
streamed and not), n, penalties and logit_bias, response_format; and their 400s."""

from __future__ import annotations

import json
import math

import jsonschema
import pytest

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Name a fruit."}]


def chat(server, **fields) -> dict:
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={"model": server.model, "messages": HI,
                                                    "max_tokens": 6, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def events(server, path: str, body: dict) -> list[dict]:
    with server.http() as http:
        r = http.post(path, json={"model": server.model, "stream": True, **body})
    assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def check_chat_entry(entry: dict, k: int) -> None:
    assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
    assert entry["bytes"] == list(entry["token"].encode()) and entry["logprob"] <= 0
    assert len(entry["top_logprobs"]) == k
    for top in entry["top_logprobs"]:
        assert set(top) == {"token", "logprob", "bytes"}
    values = [t["logprob"] for t in entry["top_logprobs"]]
    assert values == sorted(values, reverse=True)
    if k:  # greedy: the chosen token is the top one
        assert entry["logprob"] == pytest.approx(values[0])


def test_chat_logprobs_shape(server):
    reply = chat(server, logprobs=True, top_logprobs=3, temperature=0)
    choice = reply["choices"][0]
    content = choice["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    for entry in content:
        check_chat_entry(entry, 3)
    assert "".join(e["token"] for e in content).startswith(choice["message"]["content"][:3])
    assert chat(server, temperature=0)["choices"][0]["logprobs"] is None
    plain = chat(server, logprobs=True, temperature=0)["choices"][0]["logprobs"]["content"]
    assert all(e["top_logprobs"] == [] for e in plain)


def test_streamed_chat_logprobs_equal_the_unstreamed(server):
    whole = chat(server, logprobs=True, top_logprobs=2, temperature=0)
    chunks = events(server, "/v1/chat/completions",
                    {"messages": HI, "max_tokens": 6, "logprobs": True, "top_logprobs": 2,
                     "temperature": 0})
    streamed = [e for c in chunks for e in (c["choices"][0]["logprobs"] or {}).get("content", [])]
    assert [e["token"] for e in streamed] == [
        e["token"] for e in whole["choices"][0]["logprobs"]["content"]]


def test_completion_logprobs_shape_streamed_and_not(server):
    body = {"model": server.model, "prompt": "The capital of France is", "max_tokens": 5,
            "temperature": 0, "logprobs": 2}
    with server.http() as http:
        reply = http.post("/v1/completions", json=body).json()
    lp = reply["choices"][0]["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == reply["choices"][0]["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(5)]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert token in top and top[token] == value and 2 <= len(top) <= 3
        assert max(top.values()) == value  # greedy
    chunks = events(server, "/v1/completions", {k: v for k, v in body.items() if k != "model"})
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert [t for s in streamed for t in s["tokens"]] == lp["tokens"]
    assert [o for s in streamed for o in s["text_offset"]] == lp["text_offset"]


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/chat/completions", {"n": 9}, "n"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}},
     "response_format"),
])
def test_out_of_range_options_are_400(server, path, fields, param):
    body = {"model": server.model, "max_tokens": 2, **fields}
    body.update({"messages": HI} if "chat" in path else {"prompt": "Hi"})
    with server.http() as http:
        r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices(server, stream):
    body = {"messages": HI, "max_tokens": 4, "n": 3, "temperature": 1.0, "seed": 1,
            "ignore_eos": True}
    if not stream:
        reply = chat(server, **body)
        assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
        assert reply["usage"]["completion_tokens"] == 12
        return
    chunks = events(server, "/v1/chat/completions",
                    {**body, "stream_options": {"include_usage": True}})
    by_index: dict[int, list[dict]] = {}
    for c in chunks[:-1]:
        by_index.setdefault(c["choices"][0]["index"], []).append(c["choices"][0])
    assert sorted(by_index) == [0, 1, 2]
    for choices in by_index.values():
        assert choices[0]["delta"]["role"] == "assistant" and choices[-1]["finish_reason"]
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_penalties_and_logit_bias_are_honoured(server):
    base = chat(server, temperature=0, max_tokens=12)["choices"][0]["message"]["content"]
    penalised = chat(server, temperature=0, max_tokens=12, frequency_penalty=2.0,
                     presence_penalty=2.0, repetition_penalty=1.5)
    assert penalised["choices"][0]["message"]["content"] != base
    with server.http() as http:
        forced = http.post("/v1/completions", json={
            "model": server.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
            "logprobs": 0, "logit_bias": {"1000": 100}}).json()["choices"][0]["logprobs"]
        plain = http.post("/v1/completions", json={
            "model": server.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0,
            "logprobs": 0}).json()["choices"][0]["logprobs"]
    assert len(set(forced["tokens"])) == 1 and forced["tokens"] != plain["tokens"]


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["fruit", "count"],
          "properties": {"fruit": {"type": "string", "maxLength": 10},
                         "count": {"type": "integer", "minimum": 1, "maximum": 9}}}


@pytest.mark.parametrize("fmt, schema", [
    ({"type": "json_schema", "json_schema": {"name": "fruit", "schema": SCHEMA}}, SCHEMA),
    ({"type": "json_object"}, {"type": "object"}),
])
def test_response_format_returns_valid_json(server, fmt, schema):
    reply = chat(server, response_format=fmt, max_tokens=60, temperature=0)
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)


def test_logprobs_are_finite_json(server):
    reply = chat(server, logprobs=True, top_logprobs=20, temperature=1.5, seed=2)
    values = [t["logprob"] for e in reply["choices"][0]["logprobs"]["content"]
              for t in e["top_logprobs"]]
    assert values and all(math.isfinite(v) for v in values)
