"""A hostile or broken body is a 4xx in the OpenAI error shape, and the client's keep-alive
connection stays usable: each case sends the bad body, then a normal request, on one
``http.client`` connection."""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlparse

import pytest

from conftest import API_KEY

pytestmark = pytest.mark.slow

DEEP = 100_000


def _bodies(model: str) -> dict[str, tuple[bytes, int]]:
    msg = {"role": "user", "content": "Hi"}
    ok = {"model": model, "messages": [msg], "max_tokens": 2}

    def with_(**fields) -> bytes:
        return json.dumps({**ok, **fields}).encode()

    return {
        "nested lists": (b"[" * DEEP + b"]" * DEEP, 400),
        "nested objects in a field": (
            b'{"model": "m", "x": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", 400),
        "nesting under the recursion limit": (
            b'{"model": "m", "x": ' + b"[" * 500 + b"]" * 500 + b"}", 400),
        "invalid utf-8": (b'{"model": "\xc3\x28"}', 400),
        "truncated utf-8": (with_()[:-1] + b"\xe2\x82", 400),
        "a 5000-digit integer": (with_()[:-1] + b', "max_tokens": ' + b"9" * 5000 + b"}", 400),
        "an out-of-range float": (with_()[:-1] + b', "temperature": 1e999}', 400),
        "NaN": (with_()[:-1] + b', "temperature": NaN}', 400),
        "a seed torch cannot take": (with_(seed=2**70), 422),
        "a huge token-id prompt": (json.dumps({"model": model, "prompt": [0] * 500_000}).encode(),
                                   400),
        "a huge unknown array": (with_(junk=[0] * 500_000), 200),
        "a huge top-level array": (b"[" + b"0," * 500_000 + b"0]", 400),
    }


CASES = list(_bodies("m"))


def _post(conn: http.client.HTTPConnection, path: str, body: bytes) -> tuple[int, dict]:
    conn.request("POST", path, body=body, headers={
        "Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


@pytest.mark.parametrize("case", CASES)
def test_bad_body_is_4xx_and_the_connection_stays_usable(server, case):
    body, status = _bodies(server.model)[case]
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=120)
    try:
        path = "/v1/completions" if b'"prompt"' in body else "/v1/chat/completions"
        got, payload = _post(conn, path, body)
        assert got == status, payload
        if status >= 400:
            error = payload["error"]
            assert error["message"] and error["type"] and error["code"]
        sock = conn.sock
        good = {"model": server.model, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2, "temperature": 0}
        got, payload = _post(conn, "/v1/chat/completions", json.dumps(good).encode())
        assert got == 200, payload
        assert payload["choices"][0]["message"]["content"] is not None
        assert conn.sock is sock  # the same connection answered
    finally:
        conn.close()
