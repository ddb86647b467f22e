"""Tools and tool turns in a chat prompt, for any chat template.

A template that knows tools (it renders differently when given ``tools=``: checked once per
tokenizer by rendering) gets the OpenAI messages as Hugging Face templates expect them
(``tool_calls[].function.arguments`` as objects, ``tool`` turns with their
``tool_call_id``). Any other template gets what llama.cpp's generic format gives it: the
tool schemas and the envelope to answer with in a system message; each assistant turn's
calls written out in that envelope as its text; each tool result as a user turn holding
``{"tool_response": {...}}``. ``developer`` turns are system turns to every template.
"""

from __future__ import annotations

import json
from typing import Any

from slimkv.options.tool_formats import GENERIC, ToolCallFormat

Message = dict[str, Any]
_PROBE_MESSAGES = [{"role": "user", "content": "x"}]
_PROBE_TOOLS = [{"type": "function", "function": {
    "name": "probe_tool_name", "description": "d", "parameters": {"type": "object"}}}]
_KNOWS_TOOLS: dict[str, bool] = {}  # chat template text -> whether it renders tools


def template_knows_tools(hf) -> bool:
    """Whether ``hf``'s chat template renders a tool list (cached per template text)."""
    template = hf.chat_template
    if template not in _KNOWS_TOOLS:
        try:
            with_tools = hf.apply_chat_template(_PROBE_MESSAGES, tools=_PROBE_TOOLS,
                                                tokenize=False)
            _KNOWS_TOOLS[template] = "probe_tool_name" in with_tools
        except Exception:  # a template that fails on tools does not know them
            _KNOWS_TOOLS[template] = False
    return _KNOWS_TOOLS[template]


def tool_template_inputs(hf, messages: list[Message], tools: list[dict] | None,
                         fmt: ToolCallFormat) -> tuple[list[Message], list[dict] | None]:
    """The messages and ``tools=`` argument to render for this template, whose replies
    are read in ``fmt`` (:func:`serving_format`)."""
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_tool_turns:
        return [_plain(m) for m in messages], None
    if fmt.native:
        return [_native(m) for m in messages], tools or None
    names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls") or ()}
    rendered = _merge_tool_results([_generic(m, GENERIC, names) for m in messages],
                                   [m["role"] == "tool" for m in messages])
    return (_with_system(rendered, generic_system_prompt(tools)) if tools else rendered), None


def serving_format(hf, detected: ToolCallFormat) -> ToolCallFormat:
    """The format a model is asked for and held to: its own when its template renders
    tools (and so tells the model how to call them), else the generic envelope, which the
    system message then describes: prompt and grammar always agree."""
    return detected if detected.native and template_knows_tools(hf) else GENERIC


def generic_system_prompt(tools: list[dict]) -> str:
    """What a template without tools tells the model: the tools, and how to call them."""
    schemas = json.dumps([t["function"] for t in tools], indent=2)
    example = GENERIC.section([("tool_name", '{"argument": "value"}')])
    return (f"You can call these tools:\n{schemas}\n\nTo call one or more tools, answer "
            f"with a JSON object of this form and nothing after it:\n{example}\n"
            "A tool's result comes back to you in a tool_response object.")


def _plain(m: Message) -> Message:
    role = "system" if m["role"] == "developer" else m["role"]
    return {**m, "role": role, "content": m.get("content") or ""}


def _native(m: Message) -> Message:
    m = _plain(m)
    if m.get("tool_calls"):
        m["tool_calls"] = [{**c, "function": {**c["function"], "arguments":
                                              _object(c["function"]["arguments"])}}
                           for c in m["tool_calls"]]
    return m


def _generic(m: Message, fmt: ToolCallFormat, names: dict[str, str]) -> Message:
    """``names``: each call id's function, for tool turns that do not repeat it."""
    m = _plain(m)
    if m["role"] == "tool":
        call_id = m.get("tool_call_id")
        response = {"tool": m.get("name") or names.get(call_id), "tool_call_id": call_id,
                    "content": m["content"]}
        return {"role": "user", "content": json.dumps({"tool_response": response})}
    if m.get("tool_calls"):
        calls = fmt.section([(c["function"]["name"], c["function"]["arguments"] or "{}")
                             for c in m["tool_calls"]])
        return {"role": "assistant", "content": m["content"] + calls}
    return {"role": m["role"], "content": m["content"]}


def _merge_tool_results(rendered: list[Message], from_tool: list[bool]) -> list[Message]:
    """The results of parallel calls as one user turn (templates that insist on
    alternating roles refuse two user turns in a row)."""
    merged: list[Message] = []
    for message, tool in zip(rendered, from_tool):
        if tool and merged and merged[-1].get("_tool"):
            merged[-1]["content"] += "\n" + message["content"]
        else:
            merged.append({**message, "_tool": True} if tool else message)
    return [{k: v for k, v in m.items() if k != "_tool"} for m in merged]


def _with_system(messages: list[Message], text: str) -> list[Message]:
    """``text`` as the system message, after the one already there (templates may allow
    only one, first)."""
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"},
                *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _object(arguments: str) -> Any:
    """Templates format arguments themselves (``| tojson``): give them the object."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments
