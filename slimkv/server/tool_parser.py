"""Reading tool calls back out of a reply as it streams, one engine output at a time.

The grammar (:mod:`slimkv.options.tool_calls`) guarantees the form, so this is no
per-model regex parser: text until the format's trigger is content; after it, each call is
``{"name": "N", "<key>": ARGS}`` where ARGS is a JSON object whose end is found by
counting braces outside strings. A text that ends with the beginning of the trigger is held
back until the next piece tells whether the trigger follows (as the detokenizer holds back
partial stop strings); a special-token trigger never shows in the decoded text, so it is
found among the output's token ids instead.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field
from typing import NamedTuple

from slimkv.options.tool_formats import ToolCallFormat

HEADER = '{"name": "'
_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class CallDelta(NamedTuple):
    """A piece of call ``index``: its start (``id`` and ``name`` set, no arguments yet) or a
    piece of its arguments' JSON text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None


class Parsed(NamedTuple):
    content: str
    calls: list[CallDelta]


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str = ""
    done: bool = False    # its arguments' object closed

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ToolCallParser:
    fmt: ToolCallFormat
    content: str = ""                 # everything emitted as content so far
    calls: list[ToolCall] = field(default_factory=list)
    _held: str = ""                   # text that may begin the trigger
    _in_calls: bool = False
    _buffer: str = ""                 # calls section text not yet consumed
    _state: str = "seek"              # seek -> name -> key -> args -> seek ...
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False

    def feed(self, token_ids: list[int], text: str, final: bool = False) -> Parsed:
        """The content and call pieces that ``text`` (one output's new text, produced by
        ``token_ids``) completes; ``final``: the reply ended, release what was held."""
        content = ""
        if not self._in_calls:
            if self.fmt.special:
                if self.fmt.trigger_id in token_ids:
                    self._in_calls = True
                else:
                    content, text = text, ""
            else:
                content, text = self._split_at_trigger(self._held + text, final)
        self.content += content
        return Parsed(content, self._scan(text) if self._in_calls else [])

    def _split_at_trigger(self, text: str, final: bool) -> tuple[str, str]:
        at = text.find(self.fmt.trigger)
        if at >= 0:
            self._in_calls, self._held = True, ""
            return text[:at], text[at + len(self.fmt.trigger):]
        keep = 0 if final else _partial_suffix(text, self.fmt.trigger)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep], ""

    def _scan(self, text: str) -> list[CallDelta]:
        self._buffer += text
        out: list[CallDelta] = []
        while self._buffer:
            if self._state == "seek":
                at = self._buffer.find(HEADER)
                if at < 0:
                    self._buffer = self._buffer[-len(HEADER):]  # may end in part of one
                    break
                self._buffer, self._state = self._buffer[at + len(HEADER):], "name"
            elif self._state == "name":
                end = self._buffer.find('"')
                if end < 0:
                    break
                call = ToolCall(new_call_id(), self._buffer[:end])
                self.calls.append(call)
                out.append(CallDelta(len(self.calls) - 1, "", call.id, call.name))
                self._buffer, self._state = self._buffer[end + 1:], "key"
            elif self._state == "key":
                start = self._buffer.find("{")
                if start < 0:
                    break
                self._buffer, self._state = self._buffer[start:], "args"
            else:
                piece = self._take_arguments()
                self.calls[-1].arguments += piece
                self.calls[-1].done = self._state == "seek"
                out.append(CallDelta(len(self.calls) - 1, piece))
        return out

    def _take_arguments(self) -> str:
        """The buffer up to the end of the arguments object (all of it if it goes on)."""
        for i, char in enumerate(self._buffer):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif char == "\\":
                    self._escaped = True
                elif char == '"':
                    self._in_string = False
            elif char == '"':
                self._in_string = True
            elif char in "{[":
                self._depth += 1
            elif char in "}]":
                self._depth -= 1
                if self._depth == 0:
                    piece, self._buffer, self._state = (self._buffer[:i + 1],
                                                        self._buffer[i + 1:], "seek")
                    return piece
        piece, self._buffer = self._buffer, ""
        return piece

    @property
    def finished_calls(self) -> list[ToolCall]:
        return [call for call in self.calls if call.done]


def _partial_suffix(text: str, trigger: str) -> int:
    """Length of the longest end of ``text`` that begins ``trigger``."""
    for k in range(min(len(trigger) - 1, len(text)), 0, -1):
        if text.endswith(trigger[:k]):
            return k
    return 0
