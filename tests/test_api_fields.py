"""Issue 45 over HTTP, beyond scoring: vLLM's ``/tokenize``, ``/detokenize`` and
``/tokenizer_info``; the chat-template controls; ``stop_token_ids``,
``skip_special_tokens`` and ``stop`` past OpenAI's four; and no silent ignore: every field
of OpenAI's or vLLM's request schemas that slimkv does not implement is a 400 in OpenAI's
error shape naming it, while its neutral value and labels like ``user`` still pass."""

from __future__ import annotations

import pytest

from slimkv.model_io.loader import load_tokenizer
from slimkv.server.generate_request import GenerateRequest, prompt_ids
from slimkv.server.protocol import ChatCompletionRequest

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)  # the served model's tokenizer, loaded on its own


def post(server, path: str, **body):
    with server.http() as http:
        return http.post(path, json=body)


def ok(server, path: str, **body) -> dict:
    r = post(server, path, model=server.model, **body)
    assert r.status_code == 200, r.text
    return r.json()


# -- /tokenize, /detokenize, /tokenizer_info --------------------------------------------------

def test_tokenize_and_detokenize_agree_with_the_tokenizer(server, tok):
    text = "Hello world, tokenize me!"
    r = ok(server, "/tokenize", prompt=text, add_special_tokens=False, return_token_strs=True)
    ids = tok.encode(text, add_special_tokens=False)
    assert r == {"count": len(ids), "max_model_len": r["max_model_len"], "tokens": ids,
                 "token_strs": tok.hf.convert_ids_to_tokens(ids)}
    assert ok(server, "/detokenize", tokens=ids) == {"prompt": tok.decode(ids, False)}
    chat = ok(server, "/tokenize", messages=HI)
    assert chat["tokens"] == tok.apply_chat_template(HI) and chat["token_strs"] is None
    bare = ok(server, "/tokenize", messages=HI, add_generation_prompt=False)
    assert bare["tokens"] == tok.apply_chat_template(HI, add_generation_prompt=False)
    assert len(bare["tokens"]) < len(chat["tokens"])
    with server.http() as http:
        info = http.get("/tokenizer_info").json()
    assert info["eos_token"] == tok.hf.eos_token and info["chat_template"] == tok.hf.chat_template


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [10 ** 9]}, 400, "tokens"),
    ("/tokenize", {"messages": HI, "add_special_tokens": True}, 400, "add_special_tokens"),
    ("/tokenize", {"messages": HI, "chat_template_kwargs": {"tokenize": False}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {"prompt": 5}, 422, "prompt"),
])
def test_tokenizer_route_errors(server, path, body, status, param):
    r = post(server, path, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenizer_routes_need_the_api_key(server):
    import httpx

    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 401


# -- chat-template controls -------------------------------------------------------------------

def test_continue_final_message_continues_the_assistant_turn(server, tok):
    messages = HI + [{"role": "assistant", "content": "Hello! My name"}]
    reply = ok(server, "/v1/chat/completions", messages=messages, max_tokens=3, temperature=0,
               add_generation_prompt=False, continue_final_message=True)
    want = tok.apply_chat_template(messages, add_generation_prompt=False,
                                   continue_final_message=True)
    assert reply["usage"]["prompt_tokens"] == len(want)
    assert tok.decode(want).endswith("Hello! My name")  # no end-of-turn after it
    # The continuation is what a plain completion of the same ids gives.
    plain = ok(server, "/v1/completions", prompt=want, max_tokens=3, temperature=0)
    assert reply["choices"][0]["message"]["content"] == plain["choices"][0]["text"]


@pytest.mark.parametrize("fields, param", [
    ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
    ({"continue_final_message": True, "add_generation_prompt": False},
     "continue_final_message"),  # the last message is the user's
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
])
def test_contradictory_template_controls_are_400(server, fields, param):
    r = post(server, "/v1/chat/completions", model=server.model, messages=HI, **fields)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_chat_template_kwargs_reach_the_template(tok):
    """The model's own template reads no extra variable; one that does shows them arrive
    (the request's options, as the server passes them to the engine thread)."""
    own, tok.hf.chat_template = tok.hf.chat_template, (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if shout %}!!!{% endif %}")
    try:
        body = ChatCompletionRequest.model_validate(
            {"model": "m", "messages": HI, "chat_template_kwargs": {"shout": True}})
        request = GenerateRequest("r", body.template_messages(), True, lambda n: None,
                                  template=body.template_options())
        assert tok.decode(prompt_ids(tok, request)) == "Say hello.!!!"
        request.template = {}
        assert tok.decode(prompt_ids(tok, request)) == "Say hello."
    finally:
        tok.hf.chat_template = own


# -- stop_token_ids, skip_special_tokens, stop ------------------------------------------------

def test_stop_token_ids_end_the_completion(server):
    body = dict(prompt="Count: one, two, three,", max_tokens=8, temperature=0, ignore_eos=True)
    free = ok(server, "/v1/completions", logprobs=0, **body)
    tokens = free["choices"][0]["logprobs"]["tokens"]
    ids = ok(server, "/tokenize", prompt=free["choices"][0]["text"], add_special_tokens=False)
    assert len(ids["tokens"]) == len(tokens) == 8
    stop_at = ids["tokens"][2]
    first = ids["tokens"].index(stop_at)
    stopped = ok(server, "/v1/completions", stop_token_ids=[stop_at], **body)
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["usage"]["completion_tokens"] == first + 1
    assert stopped["choices"][0]["text"] == "".join(tokens[:first + 1])  # not special: kept


def test_skip_special_tokens(server, tok):
    im_start = tok.hf.convert_tokens_to_ids("<|im_start|>")
    body = dict(prompt="Hi", max_tokens=3, temperature=0, logit_bias={str(im_start): 100})
    assert ok(server, "/v1/completions", **body)["choices"][0]["text"] == ""
    kept = ok(server, "/v1/completions", skip_special_tokens=False, **body)
    assert kept["choices"][0]["text"] == "<|im_start|>" * 3
    # The end-of-turn token that ends a reply is never part of its text (vLLM's rule).
    reply = ok(server, "/v1/chat/completions", messages=HI, max_tokens=60, temperature=0,
               skip_special_tokens=False)
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert "<|im_end|>" not in reply["choices"][0]["message"]["content"]


def test_more_than_four_stop_strings(server):
    stops = ["zzz1", "zzz2", "zzz3", "zzz4", "zzz5", "zzz6", "Paris"]
    reply = ok(server, "/v1/chat/completions", max_tokens=30, temperature=0, stop=stops,
               messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert reply["choices"][0]["finish_reason"] == "stop"
    assert "Paris" not in reply["choices"][0]["message"]["content"]


# -- no silent ignore -------------------------------------------------------------------------

MSG = {"role": "user", "content": "Hi"}
BOTH = {"min_p": 0.1, "use_beam_search": True, "length_penalty": 0.5,
        "include_stop_str_in_output": True, "spaces_between_special_tokens": False,
        "truncate_prompt_tokens": 4, "allowed_token_ids": [1, 2], "bad_words": ["x"],
        "guided_json": {"type": "object"}, "guided_regex": "a+", "guided_choice": ["a"],
        "guided_grammar": "root ::= 'a'", "guided_decoding_backend": "xgrammar",
        "guided_whitespace_pattern": " ", "structured_outputs": {"json": {}},
        "structural_tag": "{}", "best_of": 3, "priority": 1,
        "request_id": "mine", "logits_processors": ["x"], "return_tokens_as_token_ids": True,
        "return_token_ids": True, "cache_salt": "s", "kv_transfer_params": {},
        "vllm_xargs": {"a": 1}, "store": True, "service_tier": "flex"}
COMPLETIONS = {**BOTH, "suffix": "the end", "prompt_embeds": "AAAA"}
CHAT = {**BOTH, "audio": {"voice": "alloy", "format": "mp3"}, "modalities": ["text", "audio"],
        "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "low",
        "verbosity": "low", "web_search_options": {}, "functions": [{"name": "f"}],
        "function_call": "auto", "prompt_cache_retention": "24h", "echo": True,
        "documents": [{"text": "x"}], "chat_template": "{{ messages }}",
        "add_special_tokens": True, "mm_processor_kwargs": {"a": 1},
        "media_io_kwargs": {"a": 1}}
PARTS = {"image_url": {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}},
         "input_audio": {"type": "input_audio", "input_audio": {"data": "AA", "format": "wav"}},
         "file": {"type": "file", "file": {"file_id": "f"}}}
CASES = ([("/v1/completions", {"prompt": "Hi", name: value}, name)
          for name, value in COMPLETIONS.items()]
         + [("/v1/chat/completions", {"messages": [MSG], name: value}, name)
            for name, value in CHAT.items()]
         + [("/v1/chat/completions", {"messages": [MSG, {"role": "user", "content": [
             {"type": "text", "text": "Look:"}, part]}]}, "messages.1.content.1.type")
            for part in PARTS.values()]
         + [("/v1/chat/completions", {"messages": [MSG], "stream": True, "stream_options": {
             "continuous_usage_stats": True}}, "stream_options.continuous_usage_stats"),
            ("/v1/chat/completions", {"messages": [MSG, {"role": "assistant", "content": "a",
                                                         "audio": {"id": "x"}}]},
             "messages.1.audio")])


@pytest.mark.parametrize("path, body, param", CASES, ids=[c[2] for c in CASES])
def test_unimplemented_fields_are_400_naming_them(server, path, body, param):
    r = post(server, path, model=server.model, max_tokens=2, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"].startswith(param)
    assert error["type"] == "invalid_request_error" and error["code"] == "unsupported_parameter"


def test_neutral_values_and_labels_pass(server):
    """Defaults, ``best_of == n``, labels, tool-calling fields (another module's) and
    fields that no schema defines are not refused."""
    neutral = {"min_p": 0.0, "use_beam_search": False, "length_penalty": 1.0, "priority": 0,
               "spaces_between_special_tokens": True, "store": False, "service_tier": "auto",
               "user": "u1", "metadata": {"a": "b"}, "safety_identifier": "s",
               "prompt_cache_key": "k", "bad_words": [], "no_such_field": 1}
    ok(server, "/v1/completions", prompt="Hi", max_tokens=2, best_of=2, n=2, suffix="",
       **neutral)
    ok(server, "/v1/chat/completions", messages=[MSG], max_tokens=2, echo=False,
       modalities=["text"], add_special_tokens=False, **neutral)


def test_the_openai_sdk_sees_the_400(server):
    import openai

    with pytest.raises(openai.BadRequestError) as caught:
        server.openai().completions.create(model=server.model, prompt="Hi", suffix="end")
    assert caught.value.body["param"] == "suffix"
