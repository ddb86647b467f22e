"""How a model writes tool calls, as data: what starts the calls section (a text trigger or a
special token), what opens it, what separates two calls and what closes it. Every call in
the section is the JSON object ``{"name": ..., "<arguments key>": {...}}``.

A format is picked from the chat template's text and the vocabulary
(:func:`detect_format`): a model is asked to call tools the way it was trained to. Models
whose template says nothing we recognise, or does not render tools, get :data:`GENERIC`,
a JSON envelope that the prompt describes to them (:mod:`slimkv.model_io.chat_tools`), as
llama.cpp's generic format does. The grammar (:mod:`slimkv.options.tool_calls`) guarantees the form; the
parser on the HTTP side (:mod:`slimkv.server.tool_stream`) reads it back.
"""

from __future__ import annotations

from typing import NamedTuple


class ToolCallFormat(NamedTuple):
    name: str
    trigger: str                 # what starts the calls section, in free text
    open: str = ""               # after the trigger, before the first call
    separator: str = ", "        # between two calls
    close: str = ""              # after the last call
    arguments_key: str = "arguments"
    trigger_id: int | None = None  # set when the trigger is one special token
    native: bool = False         # the chat template itself tells the model about tools

    @property
    def special(self) -> bool:
        """The trigger is a special token: it never shows in the decoded text, and free text
        cannot contain it (so no partial trigger is ever held back)."""
        return self.trigger_id is not None

    def call_json(self, name: str, arguments: str) -> str:
        """One call as this format writes it (``arguments``: a JSON text)."""
        return f'{{"name": "{name}", "{self.arguments_key}": {arguments}}}'

    def section(self, calls: list[tuple[str, str]]) -> str:
        """A whole calls section as text (how a history's assistant turn is shown)."""
        body = self.separator.join(self.call_json(name, args) for name, args in calls)
        return self.trigger + self.open + body + self.close


# Hermes 2 Pro, Qwen 2.5/3 and the many templates that copied them: one tag pair per call.
HERMES = ToolCallFormat("hermes", "<tool_call>", open="\n",
                        separator="\n</tool_call>\n<tool_call>\n", close="\n</tool_call>",
                        native=True)
# Llama 3.1+: <|python_tag|>, then JSON calls separated by "; " (what vLLM's llama3_json
# parser reads), with "parameters" as the arguments' key.
LLAMA3 = ToolCallFormat("llama3", "<|python_tag|>", separator="; ",
                        arguments_key="parameters", native=True)
# Mistral: [TOOL_CALLS] then one JSON array of the calls.
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", open="[", close="]", native=True)
# Every other model: an envelope the system prompt describes (the shape of llama.cpp's
# generic format, whose "tool_calls" object a model may begin after some text).
GENERIC = ToolCallFormat("generic", '{"tool_calls": [', close="]}")


def detect_format(chat_template: str | None, vocab: dict[str, int],
                  special: set[str]) -> ToolCallFormat:
    """The tool-call format of a model, from its template text and vocabulary (``special``:
    the tokens the tokenizer treats as special, which decoding drops)."""
    template = chat_template or ""
    for fmt in (MISTRAL, LLAMA3, HERMES):
        if fmt.trigger in template:
            if fmt.trigger in special and fmt.trigger in vocab:
                return fmt._replace(trigger_id=vocab[fmt.trigger])
            if fmt.trigger not in special:
                return fmt
    return GENERIC


def tokenizer_format(hf) -> ToolCallFormat:
    """:func:`detect_format` for a Hugging Face tokenizer."""
    special = set(hf.all_special_tokens)
    special |= {t.content for t in getattr(hf, "added_tokens_decoder", {}).values()
                if getattr(t, "special", False)}
    return detect_format(hf.chat_template, hf.get_vocab(), special)
