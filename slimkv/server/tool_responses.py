"""Chat replies of a request with tools: ``message.tool_calls`` (``content`` null when the
reply is only calls) and ``finish_reason: "tool_calls"``; streamed, OpenAI's tool-call
deltas: a call's first delta has its ``index``, ``id``, ``type`` and ``function.name`` with
empty ``arguments``, later ones pieces of the arguments' text."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slimkv.engine.outputs import RequestOutput, TokenLogprob
from slimkv.options.tool_formats import ToolCallFormat
from slimkv.server.payloads import chat_choice, response_envelope
from slimkv.server.responses import ChatFormat
from slimkv.server.tool_parser import CallDelta, ToolCallParser


@dataclass(slots=True)
class ToolChatFormat(ChatFormat):
    tool_format: ToolCallFormat | None = None
    parsers: dict[int, ToolCallParser] = field(default_factory=dict)  # per choice

    def feed(self, out: RequestOutput) -> Any:
        parser = self.parsers.setdefault(out.index, ToolCallParser(self.tool_format))
        return parser.feed(out.new_token_ids, out.new_text, out.finished)

    def chunks(self, out: RequestOutput, first: bool = False) -> list[dict[str, Any]]:
        parsed = self.feed(out)
        reason = self._finish_reason(out)
        deltas: list[dict[str, Any]] = [{"role": "assistant"} if first else {}]
        if parsed.content:
            deltas[0]["content"] = parsed.content
        deltas += [{"tool_calls": [_call_delta(c)]} for c in parsed.calls]
        if not deltas[0] and (len(deltas) > 1 or (reason is None and out.logprobs is None)):
            deltas.pop(0)  # nothing to say (text held back as a possible trigger)
        if not deltas:
            return []
        choices = [chat_choice(out.index, None, None, out.logprobs if i == 0 else None,
                               delta=True) for i in range(len(deltas))]
        for choice, delta in zip(choices, deltas):
            choice["delta"] = delta
        choices[-1]["finish_reason"] = reason
        return [response_envelope(self.request_id, self.chunk_object_name, self.model, [c])
                for c in choices]

    def complete(self, finals: list[RequestOutput],
                 logprobs: dict[int, list[TokenLogprob]]) -> dict[str, Any]:
        body = ChatFormat.complete(self, finals, logprobs)
        for choice, out in zip(body["choices"], finals):
            calls = self.parsers[out.index].finished_calls
            if calls:  # else (none, or cut short inside the first) the whole text is content
                choice["message"]["content"] = self.parsers[out.index].content or None
                choice["message"]["tool_calls"] = [call.as_dict() for call in calls]
            choice["finish_reason"] = self._finish_reason(out)
        return body

    def _finish_reason(self, out: RequestOutput) -> str | None:
        parser = self.parsers.get(out.index)
        if out.finish_reason == "stop" and parser is not None and parser.calls \
                and parser.calls[-1].done:  # not a stop string inside the arguments
            return "tool_calls"
        return out.finish_reason


def _call_delta(delta: CallDelta) -> dict[str, Any]:
    if delta.id is None:
        return {"index": delta.index, "function": {"arguments": delta.arguments}}
    return {"index": delta.index, "id": delta.id, "type": "function",
            "function": {"name": delta.name, "arguments": ""}}
