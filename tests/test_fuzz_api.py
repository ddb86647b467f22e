"""Schemathesis drives ``/openapi.json``: every generated request to the generation
routes and vLLM's tokenizer routes gets a non-5xx answer, every 4xx is in the ``{"error": {...}}`` shape, and all of
them travel over ONE keep-alive connection, so a request that broke the connection would
fail every later case.

The app is the real one (body parsing, validation, 400 checks, response formatting)
over a stand-in backend that answers each choice with one token (and the served model's
real tokenizer for the tokenizer routes), so the run takes seconds; the engine's own refusals (prompt too long...) are tested against the model in
tests/test_server_errors.py.
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from conftest import serve_app
from slimkv.engine.outputs import RequestOutput
from slimkv.model_io.loader import load_tokenizer
from slimkv.server.app import create_app
from slimkv.server.config import ServerConfig
from slimkv.server.scoring import PromptInfo, TokenScore

KEY = "fuzz-key"
MAX_EXAMPLES = 60


class OneTokenBackend:
    model_name = "m"
    max_model_len = 4096

    def start(self) -> None: ...

    def stop(self) -> None: ...

    async def generate(self, request):
        params = request.params = request.make_params(3)  # SamplingParams checks run
        if request.wants_prompt:  # what the engine thread sets: a three-token prompt
            scores = None if request.prompt_logprobs is None else [None] + [
                TokenScore(-1.0, 1, [(7, -1.0)] * request.prompt_logprobs)] * 2
            request.prompt_info = PromptInfo([5, 6, 7], "abc", scores,
                                             {5: "a", 6: "b", 7: "c"})
        for index in range(params.n):
            yield RequestOutput(request.request_id, [7], "ok", True, "length", 3, 1, 0,
                                text="ok", token_ids=[7], index=index)

    async def tokenizer_call(self, fn):
        return fn(TOKENIZER)  # the served model's real tokenizer, for /tokenize & co.


TOKENIZER = load_tokenizer(None)
APP = create_app(OneTokenBackend(), ServerConfig(api_key=KEY))
SCHEMA = schemathesis.openapi.from_dict(APP.openapi()).include(
    path_regex=r"^(/v1/(chat/)?completions|/tokenize|/detokenize)$")


@pytest.fixture(scope="module")
def connection():
    with serve_app(APP) as url:
        parsed = urlparse(url)
        conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=30)
        conn.connect()
        conn.first_sock = conn.sock
        yield conn
        conn.close()


@SCHEMA.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_no_dropped_connection(case, connection):
    kwargs = case.as_transport_kwargs(base_url="http://fuzz")
    body = kwargs.get("json")
    data = json.dumps(body).encode() if "json" in kwargs else (kwargs.get("data") or b"")
    if isinstance(data, str):
        data = data.encode()
    headers = {**(kwargs.get("headers") or {}), "Authorization": f"Bearer {KEY}",
               "Content-Type": "application/json"}
    connection.request(kwargs["method"], urlparse(kwargs["url"]).path, body=data,
                       headers=headers)
    response = connection.getresponse()
    payload = response.read()
    assert connection.sock is connection.first_sock, "the connection was dropped"
    assert response.status < 500, payload
    if response.status >= 400:
        error = json.loads(payload)["error"]
        assert error["message"] and error["type"] and error["code"]
    elif b"[DONE]" not in payload and "completions" in kwargs["url"]:
        reply = json.loads(payload)
        prompt = (body or {}).get("prompt")
        many = isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list))
        assert len(reply["choices"]) == (body or {}).get("n", 1) * (len(prompt) if many else 1)
