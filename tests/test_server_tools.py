"""Tool calling through a real ``slimkv serve`` and the OpenAI Python SDK: an agent loop
(a required call, the tool's result sent back, a text answer), the same streamed and
reassembled by the SDK's stream helper, ``parallel_tool_calls: false``, a named choice,
``none``, and the 400s. The embedded model is small and chooses badly; the grammar must
still guarantee the form: every call names a given tool and its arguments parse and
validate against that tool's schema (checked here with ``jsonschema``, independently of
llguidance)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.slow

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [{"type": "function", "function": {
    "name": name, "description": doc, "parameters": SCHEMAS[name], "strict": True}}
    for name, doc in (("get_weather", "The current weather in a city"),
                      ("add", "The sum of two integers"))]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    """Each call: an id, a given tool's name, arguments that are JSON valid for its schema."""
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert len({c.id for c in calls}) == len(calls)


def create(server, **fields):
    fields = {"model": server.model, "messages": ASK, "tools": TOOLS, "temperature": 0,
              "max_tokens": 80, **fields}
    return server.openai().chat.completions.create(**fields)


def test_agent_loop(server):
    """required -> the calls; the tool's results go back (role tool, the assistant turn
    with content null) -> a text answer."""
    first = create(server, tool_choice="required")
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    check_calls(choice.message.tool_calls)
    history = [*ASK, choice.message.model_dump(exclude_none=True)]
    assert history[-1]["tool_calls"] and "content" not in history[-1]
    history += [{"role": "tool", "tool_call_id": call.id,
                 "content": json.dumps({"temperature": 21, "sky": "sunny"})}
                for call in choice.message.tool_calls]
    final = create(server, messages=history, tool_choice="none", max_tokens=24).choices[0]
    assert final.message.tool_calls is None and final.finish_reason in ("stop", "length")
    assert final.message.content.strip()
    # the same history under auto: any reply, but a well-formed one
    again = create(server, messages=history, max_tokens=60).choices[0]
    if again.message.tool_calls:
        check_calls(again.message.tool_calls)
        assert again.finish_reason == "tool_calls"
    else:
        assert isinstance(again.message.content, str)


def test_streamed_calls_reassemble_to_the_unstreamed(server):
    """The SDK's stream helper rebuilds the calls from the deltas; greedy, they equal the
    unstreamed reply's (name and arguments; ids are per reply)."""
    whole = create(server, tool_choice="required").choices[0].message.tool_calls
    client = server.openai()
    with client.chat.completions.stream(model=server.model, messages=ASK, tools=TOOLS,
                                        tool_choice="required", temperature=0,
                                        max_tokens=80) as stream:
        deltas = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    check_calls(final.message.tool_calls)
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole]
    # OpenAI's delta shape: the first delta of a call names it, with empty arguments
    firsts = [c.choices[0].delta.tool_calls[0] for c in deltas
              if c.choices and c.choices[0].delta.tool_calls
              and c.choices[0].delta.tool_calls[0].id]
    assert [f.index for f in firsts] == list(range(len(whole)))
    assert all(f.function.name and f.function.arguments == "" and f.type == "function"
               for f in firsts)


def test_sampled_calls_always_validate(server):
    """Sampling (temperature 1, n choices), every choice's calls are well formed."""
    reply = create(server, tool_choice="required", temperature=1.0, seed=7, n=4,
                   messages=[{"role": "user", "content": "Add 17 and 25, and tell me the "
                              "weather in Oslo in fahrenheit."}], max_tokens=120)
    assert len(reply.choices) == 4
    for choice in reply.choices:
        if choice.finish_reason == "tool_calls":
            check_calls(choice.message.tool_calls)
        else:  # ran out of tokens inside a call: then only the finished calls are given
            assert choice.finish_reason == "length"
            if choice.message.tool_calls:
                check_calls(choice.message.tool_calls)


def test_parallel_false_gives_one_call(server):
    ask = [{"role": "user", "content": "Weather in Paris, London, Rome and Oslo?"}]
    for seed in range(3):
        reply = create(server, messages=ask, tool_choice="required", temperature=1.0,
                       seed=seed, parallel_tool_calls=False, max_tokens=120).choices[0]
        assert reply.finish_reason == "tool_calls"
        assert len(reply.message.tool_calls) == 1
        check_calls(reply.message.tool_calls)


def test_named_choice_calls_that_function(server):
    """The model is asked about weather; the choice names add, so add it is (once)."""
    reply = create(server, tool_choice={"type": "function", "function": {"name": "add"}})
    calls = reply.choices[0].message.tool_calls
    check_calls(calls, names=("add",))
    assert len(calls) == 1
    assert reply.choices[0].finish_reason == "tool_calls"


def test_none_never_calls(server):
    for seed in range(2):
        reply = create(server, tool_choice="none", temperature=1.0, seed=seed,
                       max_tokens=40).choices[0]
        assert reply.message.tool_calls is None and reply.finish_reason != "tool_calls"
        assert isinstance(reply.message.content, str)


def test_auto_is_well_formed(server):
    for seed in range(3):
        reply = create(server, temperature=1.0, seed=seed, max_tokens=60).choices[0]
        if reply.message.tool_calls:
            check_calls(reply.message.tool_calls)
        else:
            assert isinstance(reply.message.content, str)


@pytest.mark.parametrize("fields, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": 5}}}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "string"}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400(server, fields, param):
    body = {"model": server.model, "messages": ASK, "tools": TOOLS, "max_tokens": 4, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    with server.http() as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"]
    with pytest.raises(openai.BadRequestError):  # and the SDK sees a 400
        server.openai().chat.completions.create(**body)


def test_openapi_describes_the_tool_fields(server):
    with server.http() as http:
        schemas = http.get("/openapi.json").json()["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat)
    message = schemas["ChatMessage"]["properties"]
    assert {"tool_calls", "tool_call_id", "name"} <= set(message)
    assert {"tool", "developer"} <= set(message["role"]["enum"])
    assert "tool_calls" in schemas["AssistantMessage"]["properties"]


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_stream_reassembled_by_hand_equals_the_reply(server, choice):
    """The chunks, joined by hand (content pieces; calls by index: the first delta's id and
    name, then the arguments' pieces), give the unstreamed reply's content and calls."""
    ask = [{"role": "user", "content": "Add 2 and 3, then tell me the weather in Rome."}]
    whole = create(server, messages=ask, tool_choice=choice, max_tokens=100).choices[0]
    chunks = create(server, messages=ask, tool_choice=choice, max_tokens=100, stream=True)
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            if part.id:
                assert part.index not in calls and part.function.arguments == ""
                calls[part.index] = [part.function.name, ""]
            else:
                calls[part.index][1] += part.function.arguments
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == whole.finish_reason and not any(reasons[:-1])
    got = [tuple(calls[i]) for i in sorted(calls)]
    want = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    if whole.finish_reason == "length" and calls:  # cut inside a call: the unstreamed
        assert whole.message.content.startswith(content)  # reply shows the raw text
    else:
        assert got == want and (content or None) == whole.message.content
