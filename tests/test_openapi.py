"""``/openapi.json`` describes the generation routes' request and response bodies (the
server still parses bodies itself), and ``/docs`` renders."""

from __future__ import annotations

from fastapi.testclient import TestClient

from slimkv.server.app import create_app
from slimkv.server.config import ServerConfig


class NoEngine:
    model_name = "m"
    max_model_len = 64

    def start(self) -> None: ...

    def stop(self) -> None: ...


def _schema() -> dict:
    with TestClient(create_app(NoEngine(), ServerConfig())) as client:
        return client.get("/openapi.json").json()


def _resolve(schema: dict, ref: str) -> dict:
    return schema["components"]["schemas"][ref.rsplit("/", 1)[1]]


def test_generation_routes_declare_their_bodies():
    schema = _schema()
    for path, request, fields, response in [
            ("/v1/chat/completions", "ChatCompletionRequest", {"model", "messages"},
             "ChatCompletion"),
            ("/v1/completions", "CompletionRequest", {"model", "prompt"}, "Completion")]:
        op = schema["paths"][path]["post"]
        body = op["requestBody"]["content"]["application/json"]["schema"]
        model = _resolve(schema, body["$ref"])
        assert model["title"] == request and fields <= set(model["required"])
        ok = op["responses"]["200"]["content"]
        assert _resolve(schema, ok["application/json"]["schema"]["$ref"])["title"] == response
        assert "text/event-stream" in ok
        error = op["responses"]["400"]["content"]["application/json"]["schema"]
        assert _resolve(schema, error["$ref"])["required"] == ["error"]


def test_the_issue_45_fields_are_described():
    """Scoring, template and detokenizer options, and vLLM's tokenizer routes."""
    schema = _schema()
    props = {name: _resolve(schema, f"/{name}")["properties"]
             for name in ("ChatCompletionRequest", "CompletionRequest")}
    shared = {"prompt_logprobs", "stop_token_ids", "skip_special_tokens"}
    assert shared | {"echo", "add_special_tokens"} <= set(props["CompletionRequest"])
    assert shared | {"chat_template_kwargs", "add_generation_prompt",
                     "continue_final_message"} <= set(props["ChatCompletionRequest"])
    prompt_kinds = {(kind["type"], kind.get("items", {}).get("type"))
                    for kind in props["CompletionRequest"]["prompt"]["anyOf"]}
    assert prompt_kinds == {("string", None), ("array", "integer"), ("array", "string"),
                            ("array", "array")}  # a text, ids, or a list of either
    for path in ("/tokenize", "/detokenize"):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]
    assert "/tokenizer_info" in schema["paths"]


def test_every_reference_resolves():
    schema = _schema()
    text = str(schema)
    refs = {part.split("'")[0] for part in text.split("'$ref': '")[1:]}
    assert refs and all(_resolve(schema, ref) for ref in refs)


def test_docs_page_renders():
    with TestClient(create_app(NoEngine(), ServerConfig())) as client:
        page = client.get("/docs")
    assert page.status_code == 200 and "swagger-ui" in page.text and "/openapi.json" in page.text
