"""Prompt scoring over HTTP (issue 45): completions' ``echo`` with ``logprobs`` and vLLM's
``prompt_logprobs`` against the engine's own teacher-forced :meth:`LLMEngine.score`
(a second engine built from the same config), with and without a prefix-cache hit; a list
of prompts against the same prompts one by one; ``max_tokens: 0``; streaming."""

from __future__ import annotations

import json
import uuid

import pytest
import torch

from conftest import small_config

pytestmark = pytest.mark.slow

TEXT = ("The capital of France is Paris. The capital of Italy is Rome. The capital of "
        "Spain is Madrid. The capital of Germany is Berlin. The capital of Portugal is")


@pytest.fixture(scope="module")
def reference():
    """An engine like the server's (the same config): its score() is the reference."""
    from slimkv.plugins import build_engine

    return build_engine(small_config())


def teacher_forced(engine, ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: row i is the distribution of token i + 1 given those before it."""
    return engine.score(ids).float().log_softmax(-1)[:-1]


def expected_logprobs(engine, ids: list[int]) -> list[float]:
    raw = teacher_forced(engine, ids)
    return raw.gather(1, torch.tensor(ids[1:]).unsqueeze(1))[:, 0].tolist()


def complete(server, **body) -> dict:
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": server.model, **body})
    assert r.status_code == 200, r.text
    return r.json()


def unique(text: str) -> str:
    """A prompt whose first blocks nobody sent before (a sure prefix-cache miss)."""
    return f"Note {uuid.uuid4().hex[:12]}. {text}"


def test_echo_logprobs_equal_teacher_forcing_with_and_without_a_prefix_hit(server, reference):
    text = unique(TEXT)
    ids = reference.tokenizer.encode(text)
    want = expected_logprobs(reference, ids)
    texts = reference.tokenizer.token_texts(ids)
    body = dict(prompt=ids, echo=True, logprobs=1, max_tokens=1, temperature=0)
    replies = [complete(server, **body), complete(server, **body)]
    assert replies[0]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert replies[1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a hit
    for reply in replies:
        choice = choice0 = reply["choices"][0]
        lp = choice["logprobs"]
        assert lp["tokens"][:len(ids)] == texts and len(lp["tokens"]) == len(ids) + 1
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["token_logprobs"][1:len(ids)] == want  # exactly: the same pass
        for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:],
                                     lp["top_logprobs"][1:]):
            assert top[token] == value and 1 <= len(top) <= 2
        assert choice0["text"].startswith(reference.tokenizer.decode(ids, False))
    # The generated token's logprob (decode path) against teacher forcing over prompt + it.
    generated = reference.tokenizer.encode(replies[0]["choices"][0]["text"][len(text):], False)
    full = expected_logprobs(reference, ids + generated[:1])
    assert replies[0]["choices"][0]["logprobs"]["token_logprobs"][-1] == pytest.approx(
        full[-1], abs=0.05)  # int8 KV read back vs the prefill's own rows: not bit-equal


def test_prompt_logprobs_on_completions_and_chat(server, reference):
    text = unique("Name three colours of the rainbow.")
    ids = reference.tokenizer.encode(text)
    raw = teacher_forced(reference, ids)
    reply = complete(server, prompt=text, prompt_logprobs=3, max_tokens=2, temperature=0)
    entries = reply["choices"][0]["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    assert reply["choices"][0]["logprobs"] is None  # not asked for
    for i, entry in enumerate(entries[1:]):
        row, token = raw[i], ids[i + 1]
        mine = entry[str(token)]
        assert mine["logprob"] == row[token].item()
        assert mine["rank"] == int((row > row[token]).sum()) + 1
        assert mine["decoded_token"] == reference.tokenizer.token_texts([token])[0]
        top = row.topk(3)
        for rank, (value, other) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
            assert entry[str(other)]["logprob"] == value
            if other != token:
                assert entry[str(other)]["rank"] == rank
        assert set(entry) <= {str(token), *map(str, top.indices.tolist())}

    messages = [{"role": "user", "content": unique("What is two plus two?")}]
    with server.http() as http:
        r = http.post("/v1/chat/completions", json={
            "model": server.model, "messages": messages, "max_tokens": 2, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    chat_ids = reference.tokenizer.apply_chat_template(messages)
    entries = r.json()["prompt_logprobs"]
    assert len(entries) == len(chat_ids) == r.json()["usage"]["prompt_tokens"]
    assert entries[0] is None and all(len(e) == 1 for e in entries[1:])
    got = [e[str(t)]["logprob"] for e, t in zip(entries[1:], chat_ids[1:])]
    assert got == expected_logprobs(reference, chat_ids)


def test_a_list_of_prompts_equals_the_prompts_one_by_one(server, reference):
    texts = [unique("Once upon a time"), unique("The sky is"), unique("Two plus two is")]
    tokens = [reference.tokenizer.encode(t) for t in texts]
    body = dict(echo=True, logprobs=1, max_tokens=4, temperature=0, n=2)
    singles = [complete(server, prompt=t, **body) for t in texts]
    for prompt in (texts, tokens):  # texts, and token-id lists as lm-eval sends them
        batched = complete(server, prompt=prompt, **body)
        choices = batched["choices"]
        assert [c["index"] for c in choices] == list(range(6))
        for p, single in enumerate(singles):
            for i, alone in enumerate(single["choices"]):
                together = choices[p * 2 + i]
                assert together["text"] == alone["text"]
                lp, lp_alone = together["logprobs"], alone["logprobs"]
                assert lp["tokens"] == lp_alone["tokens"]
                n = len(tokens[p])
                assert lp["token_logprobs"][:n] == lp_alone["token_logprobs"][:n]
                assert lp["token_logprobs"][n:] == pytest.approx(lp_alone["token_logprobs"][n:],
                                                                 abs=0.05)  # batched decode
        usage = batched["usage"]
        assert usage["prompt_tokens"] == sum(map(len, tokens))
        assert usage["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles)


def test_streamed_list_of_prompts_with_echo(server):
    prompts = [unique("Hello"), unique("Good morning")]
    body = dict(prompt=prompts, echo=True, max_tokens=3, temperature=0)
    whole = complete(server, **body)
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": server.model, "stream": True, **body})
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for chunk in map(json.loads, lines[:-1]):
        choice = chunk["choices"][0]
        if choice["index"] not in texts:
            assert choice["text"].startswith(prompts[choice["index"]])  # echoed first
        texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}


def test_echo_with_max_tokens_zero_returns_the_prompt_only(server, reference):
    text = unique("A quiet evening by the sea")
    ids = reference.tokenizer.encode(text)
    reply = complete(server, prompt=text, echo=True, logprobs=0, max_tokens=0)
    choice = reply["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert choice["logprobs"]["token_logprobs"][1:] == expected_logprobs(reference, ids)
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert reply["usage"]["completion_tokens"] == 0
    assert reply["usage"]["prompt_tokens"] == len(ids)
    with server.http() as http:  # streamed: one chunk, the same choice
        r = http.post("/v1/completions", json={"model": server.model, "prompt": text,
                                               "echo": True, "logprobs": 0, "max_tokens": 0,
                                               "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    assert [c["choices"][0] for c in chunks] == [choice]


@pytest.mark.parametrize("path, fields, param", [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                              "prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_scoring_options_out_of_range_are_400(server, path, fields, param):
    with server.http() as http:
        r = http.post(path, json={"model": server.model, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_openai_sdk_echo_and_prompt_lists(server):
    """The official client sends both (``prompt`` as a list, ``echo``)."""
    client = server.openai()
    reply = client.completions.create(model=server.model, prompt=["Red", "Blue"], echo=True,
                                      logprobs=0, max_tokens=1, temperature=0)
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].text.startswith("Red") and reply.choices[1].text.startswith("Blue")
    assert reply.choices[0].logprobs.token_logprobs[0] is None


def test_staggered_prompts_start_one_after_another() -> None:
    """A cluster's list of prompts: prompt p + 1's request starts only once prompt p's has
    answered (Ray Serve's router could lose one of two calls made at once from one HTTP
    request); unstaggered, all start at once. Either way every output arrives, renumbered."""
    import asyncio

    from slimkv.engine.outputs import RequestOutput
    from slimkv.server.responses import merge_outputs

    def outputs(p: int, started: list[int]):
        async def gen():
            started.append(p)
            await asyncio.sleep(0.01)
            yield RequestOutput(f"r{p}", [p], str(p), True, "stop", 1, 1, 0)
        return gen()

    async def run(stagger: bool) -> tuple[list[int], list[int]]:
        started: list[int] = []
        merged = merge_outputs([outputs(p, started) for p in range(3)], 1, stagger=stagger)
        seen = []
        async for out in merged:
            seen.append((out.index, list(started)))
        return seen

    staggered = asyncio.run(run(True))
    assert [i for i, _ in staggered] == [0, 1, 2]
    assert [s for _, s in staggered] == [[0], [0, 1], [0, 1, 2]]  # none before p answered
    together = asyncio.run(run(False))
    assert sorted(i for i, _ in together) == [0, 1, 2] and together[0][1] == [0, 1, 2]
