"""One llguidance Lark grammar per tool-calling request: free text, in which a calls section,
once its trigger is written, is held to the format (:mod:`slimkv.options.tool_formats`)
and each call to one tool's name and parameter schema.

``auto``: free text, or free text then the calls section. A text trigger is a *lazy*
lexeme (llguidance ends it at the first place it matches), so the first time the trigger
appears in the text the calls begin; a special-token trigger is a token free text cannot
contain. ``required`` and a named function force the calls section from the first token
(the server gives a named choice only that tool and one call, as vLLM does).
``parallel_tool_calls: false`` allows one call.
After the section only end-of-sequence is allowed: the turn ends with its calls.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from slimkv.options.tool_formats import ToolCallFormat

TEXT = r"TEXT: /(.|\n)*/"


class ToolSpec(NamedTuple):
    name: str             # OpenAI's pattern: [a-zA-Z0-9_-]{1,64}, so safe inside literals
    parameters: str       # the JSON schema of its arguments (canonical JSON text)


def tool_grammar(fmt: ToolCallFormat, tools: list[ToolSpec], forced: bool,
                 parallel: bool) -> str:
    """The Lark grammar of a reply that may (``forced``: must) call ``tools``."""
    trigger = f"<[{fmt.trigger_id}]>" if fmt.special else _string(fmt.trigger)
    if forced:
        start = f"start: {trigger} section"
    elif fmt.special:
        start = f"start: TEXT | TEXT {trigger} section"
    else:  # the lazy rule: the text up to the first trigger, which then must be followed
        start = f"start: TEXT | text_then_trigger section\ntext_then_trigger[lazy]: TEXT {trigger}"
    repeat = f"({_literal(fmt, fmt.separator)} call)*" if parallel else ""
    calls = " | ".join(f"tool_{i}" for i in range(len(tools)))
    lines = ["%llguidance {}", start,
             f"section: {_literal(fmt, fmt.open)} call {repeat} {_literal(fmt, fmt.close)}",
             f'call: "{{\\"name\\": \\"" ({calls}) "}}"']
    for i, tool in enumerate(tools):
        head = _string(f'{tool.name}", "{fmt.arguments_key}": ')
        lines.append(f"tool_{i}: {head} %json {_one_line(tool.parameters)}")
    lines.append(TEXT)
    return "\n".join(lines) + "\n"


def _string(text: str) -> str:
    return json.dumps(text) if text else ""


def _literal(fmt: ToolCallFormat, text: str) -> str:
    """``text`` as grammar items; where it contains a special trigger (Hermes' separator
    repeats ``<tool_call>``), that part is the token itself, not its spelling."""
    if not fmt.special:
        return _string(text)
    token = f"<[{fmt.trigger_id}]>"
    return f" {token} ".join(_string(part) for part in text.split(fmt.trigger)).strip()


def _one_line(schema: str) -> str:
    return json.dumps(json.loads(schema), separators=(",", ":"))
