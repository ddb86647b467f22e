"""Tool calling's parts without a server: format detection, the grammar (driven token by
token through llguidance with the embedded model's tokenizer), the streaming parser (split
at every character against ``json.loads`` of the whole), and the prompt rendering."""

from __future__ import annotations

import copy
import json

import llguidance
import llguidance.hf
import pytest

from slimkv.model_io.chat_tools import (serving_format, template_knows_tools,
                                        tool_template_inputs)
from slimkv.model_io.loader import load_tokenizer
from slimkv.options.tool_calls import ToolSpec, tool_grammar
from slimkv.options.tool_formats import (GENERIC, HERMES, LLAMA3, MISTRAL, detect_format)
from slimkv.server.tool_parser import ToolCallParser

WEATHER = json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"], "additionalProperties": False})
ADD = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                  "required": ["a"], "additionalProperties": False})
SPECS = [ToolSpec("get_weather", WEATHER), ToolSpec("add", ADD)]
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALL2 = '{"name": "add", "arguments": {"a": 4}}'


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def lltok(tokenizer):
    return llguidance.hf.from_tokenizer(tokenizer.hf, n_vocab=tokenizer.vocab_size,
                                        eos_token=sorted(tokenizer.eos_token_ids))


def accepts(lltok, tokenizer, grammar: str, ids: list[int]) -> bool:
    """Whether the grammar takes every token of ``ids`` and may then end."""
    matcher = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not matcher.is_error(), matcher.get_error()
    return all(matcher.consume_token(i) for i in ids) and matcher.is_accepting()


def test_formats_are_detected_from_template_and_vocabulary(tokenizer):
    assert tokenizer.tool_format == GENERIC  # SmolLM2's template knows no tools
    assert detect_format("{{ '<tool_call>' }}", {"<tool_call>": 7}, set()) == HERMES
    llama = detect_format("<|python_tag|>", {"<|python_tag|>": 128010}, {"<|python_tag|>"})
    assert llama.trigger_id == 128010 and llama.arguments_key == "parameters"
    assert detect_format("[TOOL_CALLS]", {"[TOOL_CALLS]": 5}, {"[TOOL_CALLS]"}) == \
        MISTRAL._replace(trigger_id=5)
    # a special trigger the vocabulary lacks: the model cannot write it
    assert detect_format("<|python_tag|>", {}, {"<|python_tag|>"}) == GENERIC
    assert LLAMA3.section([("f", "{}"), ("g", "{}")]) == \
        '<|python_tag|>{"name": "f", "parameters": {}}; {"name": "g", "parameters": {}}'


@pytest.mark.parametrize("fmt", [GENERIC, HERMES])
def test_text_trigger_grammar(tokenizer, lltok, fmt):
    auto = tool_grammar(fmt, SPECS, forced=False, parallel=True)
    enc = tokenizer.hf.encode
    assert accepts(lltok, tokenizer, auto, enc("Just an answer, no call."))
    both = fmt.section([("get_weather", '{"city": "Paris"}'), ("add", '{"a": 4}')])
    assert accepts(lltok, tokenizer, auto, enc("Let me look. " + both))
    assert not accepts(lltok, tokenizer, auto, enc(fmt.trigger + fmt.open + '{"name": "nope"'))
    bad_args = fmt.section([("add", '{"a": "four"}')])  # the schema wants an integer
    assert not accepts(lltok, tokenizer, auto, enc(bad_args))
    one = tool_grammar(fmt, SPECS, forced=False, parallel=False)
    assert accepts(lltok, tokenizer, one, enc(fmt.section([("add", '{"a": 4}')])))
    assert not accepts(lltok, tokenizer, one, enc(both))
    forced = tool_grammar(fmt, SPECS, forced=True, parallel=True)
    assert accepts(lltok, tokenizer, forced, enc(both))
    assert not accepts(lltok, tokenizer, forced, enc("Sure. " + both))


def test_special_token_trigger_grammar(tokenizer, lltok):
    """A special trigger is the token itself (here SmolLM2's <|im_start|>, id 1, standing in
    for <|python_tag|>): text cannot spell it, and the calls follow the token."""
    fmt = LLAMA3._replace(trigger="<|im_start|>", trigger_id=1)
    grammar = tool_grammar(fmt, SPECS, forced=False, parallel=True)
    call = tokenizer.hf.encode('{"name": "add", "parameters": {"a": 4}}')
    assert accepts(lltok, tokenizer, grammar, tokenizer.hf.encode("Hi. ") + [1] + call)
    assert accepts(lltok, tokenizer, grammar, tokenizer.hf.encode("Hi."))
    assert not accepts(lltok, tokenizer, grammar, tokenizer.hf.encode("Hi. ") + [1] + [1])


@pytest.mark.parametrize("fmt", [GENERIC, HERMES, MISTRAL, LLAMA3])
def test_parser_at_every_split(fmt):
    """Content before the trigger, then each call's name and arguments, however the text is
    cut into pieces (a partial trigger is held back, never shown as content)."""
    text = "Checking the weather {x}. " + fmt.section(
        [("get_weather", '{"city": "Pa\\"ris {"}'), ("add", '{"a": 4}')])
    for cut in range(len(text) + 1):
        parser = ToolCallParser(fmt)
        shown = [parser.feed([], piece).content for piece in (text[:cut], text[cut:])]
        shown.append(parser.feed([], "", final=True).content)
        assert "".join(shown) == "Checking the weather {x}. " == parser.content
        assert [(c.name, json.loads(c.arguments)) for c in parser.calls] == \
            [("get_weather", {"city": 'Pa"ris {'}), ("add", {"a": 4})]
        assert not any(fmt.trigger[:3] in s for s in shown)


def test_parser_without_calls_releases_held_text():
    parser = ToolCallParser(GENERIC)
    assert parser.feed([], 'a {"tool').content == "a "
    assert parser.feed([], "", final=True).content == '{"tool'
    assert parser.calls == []


def test_parser_special_trigger_from_token_ids():
    fmt = LLAMA3._replace(trigger_id=99)
    parser = ToolCallParser(fmt)
    assert parser.feed([5], "Hi ").content == "Hi "
    parsed = parser.feed([99], "")
    assert parsed.content == "" and parsed.calls == []
    parser.feed([6], '{"name": "add", "parameters": {"a"')
    parser.feed([7], ": 1}}", final=True)
    assert [(c.name, c.arguments) for c in parser.calls] == [("add", '{"a": 1}')]


HISTORY = [{"role": "developer", "content": "Be brief."},
           {"role": "user", "content": "Weather?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters":
                                           json.loads(WEATHER)}}]


def test_generic_rendering(tokenizer):
    """A template without tools: one system message (the developer's, then the tools and
    the envelope), the call as envelope text, the result as a tool_response user turn."""
    assert not template_knows_tools(tokenizer.hf)
    assert serving_format(tokenizer.hf, HERMES) == GENERIC  # the template cannot show tools
    messages, tools = tool_template_inputs(tokenizer.hf, HISTORY, TOOLS, GENERIC)
    assert tools is None and [m["role"] for m in messages] == [
        "system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n") and '"get_weather"' in \
        messages[0]["content"] and GENERIC.trigger in messages[0]["content"]
    assert messages[2]["content"] == GENERIC.section([("get_weather", '{"city": "Paris"}')])
    assert json.loads(messages[3]["content"]) == {"tool_response": {
        "tool": "get_weather", "tool_call_id": "call_1", "content": "sunny"}}
    text = tokenizer.hf.decode(tokenizer.apply_chat_template(HISTORY, TOOLS))
    assert "<|im_start|>assistant\n" + GENERIC.trigger in text


def test_native_rendering(tokenizer):
    """A template that knows tools gets them, and the calls' arguments as objects."""
    hf = copy.deepcopy(tokenizer.hf)
    hf.chat_template = (
        "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}{% for m in messages %}"
        "<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
        "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}\n{% endfor %}")
    assert template_knows_tools(hf) and serving_format(hf, HERMES) == HERMES
    messages, tools = tool_template_inputs(hf, HISTORY, TOOLS, HERMES)
    assert tools == TOOLS and messages[0]["role"] == "system"
    text = hf.apply_chat_template(messages, tools=tools, tokenize=False)
    assert '"arguments": {"city": "Paris"}' in text and "<tool>sunny" in text


def test_parallel_results_are_one_user_turn(tokenizer):
    history = [*HISTORY[1:3], HISTORY[3], {"role": "tool", "tool_call_id": "call_1",
                                           "content": "windy"}]
    messages, _ = tool_template_inputs(tokenizer.hf, history, TOOLS, GENERIC)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    results = [json.loads(line)["tool_response"]["content"]
               for line in messages[-1]["content"].splitlines()]
    assert results == ["sunny", "windy"]


def test_parser_marks_unfinished_calls():
    parser = ToolCallParser(GENERIC)
    parser.feed([], GENERIC.trigger + CALL + ", " + CALL2[:-4])
    assert [c.name for c in parser.calls] == ["get_weather", "add"]
    assert [c.name for c in parser.finished_calls] == ["get_weather"]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", [HERMES, MISTRAL._replace(trigger="<|im_start|>", trigger_id=1),
                                 GENERIC], ids=["hermes", "special-trigger", "generic"])
def test_engine_follows_each_format(fmt):
    """The embedded model held to each format's grammar (forced, parallel): its output
    parses into calls whose arguments validate, whatever format it was trained on."""
    import jsonschema

    from conftest import small_config
    from slimkv.engine.sampling_params import SamplingParams

    llm = _llm(small_config)
    grammar = tool_grammar(fmt, SPECS, forced=True, parallel=True)
    results = llm.chat([[{"role": "user", "content": "Weather in Oslo? And add 3."}]] * 2, [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, grammar=grammar)
        for s in range(2)])
    for result in results:
        parser = ToolCallParser(fmt)
        parser.feed(result.token_ids, result.text, final=True)
        assert parser.content == "" and parser.finished_calls, result.text
        for call in parser.finished_calls:
            schema = json.loads(dict(SPECS)[call.name])
            jsonschema.validate(json.loads(call.arguments), schema)
        if result.finish_reason == "stop":
            assert all(c.done for c in parser.calls)


_LLM = []


def _llm(small_config):
    if not _LLM:
        from slimkv.llm import LLM
        _LLM.append(LLM(small_config()))
    return _LLM[0]


def test_a_refused_history_is_a_value_error(tokenizer):
    """A template's raise_exception (roles, call ids) reaches the client as a 400."""
    original = tokenizer.hf.chat_template
    tokenizer.hf.chat_template = "{{ raise_exception('roles must alternate') }}"
    try:
        with pytest.raises(ValueError, match="roles must alternate"):
            tokenizer.apply_chat_template(HISTORY, TOOLS)
    finally:
        tokenizer.hf.chat_template = original
