"""No silent ignore: a field of OpenAI's or vLLM's request schemas that slimkv does not
implement is a 400 naming it, when its value asks for something (a non-default value).

A client that sends ``suffix``, ``best_of: 3``, an image or ``min_p`` expects an answer
shaped by it; answering without it, with a 200, would be a wrong answer it cannot detect.
Fields that no schema defines are still ignored, as vLLM and OpenAI ignore them, and so are
fields that only label a request (``user``, ``metadata``, ``safety_identifier``,
``prompt_cache_key``). The tool-calling fields (``tools``, ``tool_choice``,
``parallel_tool_calls``) are not refused here: the chat schema owns them.

Checked on the parsed JSON before the request models, so a refused field gets its 400
whatever its type; a value of the wrong type counts as asking for something.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from slimkv.server.errors import APIError

Check = Callable[[Any, dict[str, Any]], bool]  # (value, body) -> refused


class Field(NamedTuple):
    name: str
    refused: Check
    why: str


def given(value: Any, body: dict[str, Any]) -> bool:
    return value is not None


def truthy(value: Any, body: dict[str, Any]) -> bool:
    return bool(value)


def other_than(*allowed: Any) -> Check:
    return lambda value, body: value is not None and value not in allowed


def _best_of(value: Any, body: dict[str, Any]) -> bool:
    # best_of == n keeps every candidate: the same as n alone.
    return value is not None and value not in (1, body.get("n", 1))


def _modalities(value: Any, body: dict[str, Any]) -> bool:
    return value is not None and value != ["text"]


GUIDED = "is not implemented; use response_format (json_schema or json_object)"
BOTH = [
    Field("min_p", other_than(0, 0.0), "(min-p sampling) is not implemented; use top_p/top_k"),
    Field("use_beam_search", truthy, "beam search is not implemented"),
    Field("length_penalty", other_than(1, 1.0), "(beam search) is not implemented"),
    Field("include_stop_str_in_output", truthy, "is not implemented"),
    Field("spaces_between_special_tokens", other_than(True), "is not implemented"),
    Field("truncate_prompt_tokens", given, "is not implemented"),
    Field("allowed_token_ids", given, "is not implemented; use logit_bias"),
    Field("bad_words", truthy, "is not implemented; use logit_bias"),
    *(Field(name, given, GUIDED) for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar",
        "guided_decoding_backend", "guided_whitespace_pattern", "structured_outputs",
        "structural_tag")),
    Field("best_of", _best_of, "above n is not implemented (no candidates are ranked)"),
    Field("priority", other_than(0), "(priority scheduling) is not implemented"),
    Field("request_id", given, "is not implemented: the server names each request"),
    Field("logits_processors", truthy, "(custom logits processors) is not implemented"),
    Field("return_tokens_as_token_ids", truthy, "is not implemented"),
    Field("return_token_ids", truthy, "is not implemented; use /tokenize"),
    Field("cache_salt", given, "(prefix-cache isolation) is not implemented"),
    Field("kv_transfer_params", given, "(disaggregated prefill) is not implemented"),
    Field("vllm_xargs", given, "is not implemented"),
    Field("store", truthy, "is not implemented: slimkv stores no completions"),
    Field("service_tier", other_than("auto", "default"), "(processing tiers) is not "
          "implemented: every request is served alike"),
]
COMPLETIONS = [
    *BOTH,
    Field("suffix", truthy, "(insertion after the completion) is not implemented"),
    Field("prompt_embeds", given, "is not implemented; send text or token ids"),
]
CHAT = [
    *BOTH,
    Field("audio", given, "(audio output) is not implemented"),
    Field("modalities", _modalities, "other than [\"text\"] are not implemented"),
    Field("prediction", given, "(predicted outputs) is not implemented"),
    Field("reasoning_effort", given, "is not implemented: this model does not reason"),
    Field("verbosity", given, "is not implemented"),
    Field("web_search_options", given, "(web search) is not implemented"),
    Field("functions", truthy, "(deprecated) is not implemented; use tools"),
    Field("function_call", given, "(deprecated) is not implemented; use tool_choice"),
    Field("prompt_cache_retention", given, "is not implemented: the prefix cache keeps "
          "blocks while the pool has room"),
    Field("echo", truthy, "(prepending the last message) is not implemented"),
    Field("documents", truthy, "(retrieval documents for the template) is not implemented"),
    Field("chat_template", given, "(a template sent with the request) is not implemented; "
          "the model's own template is used"),
    Field("add_special_tokens", truthy, "is not implemented for chat (the template "
          "places the special tokens)"),
    Field("mm_processor_kwargs", truthy, "(multi-modal input) is not implemented"),
    Field("media_io_kwargs", truthy, "(multi-modal input) is not implemented"),
]
STREAM_OPTIONS = [Field("continuous_usage_stats", truthy, "is not implemented")]
MESSAGE = [Field("audio", given, "(a reference to earlier audio output) is not implemented")]


def refuse_unsupported(body: dict[str, Any], fields: list[Field]) -> None:
    """Raise the 400 for the first field of ``fields`` (or of ``stream_options``, or of a
    chat message and its content parts) that asks for something slimkv does not do."""
    _check(body, fields, body, "")
    if isinstance(options := body.get("stream_options"), dict):
        _check(options, STREAM_OPTIONS, body, "stream_options.")
    messages = body.get("messages") if fields is CHAT else None
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(message, dict):
            continue
        _check(message, MESSAGE, body, f"messages.{i}.")
        content = message.get("content")
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise _refusal(f"messages.{i}.content.{j}.type",
                               f"{kind!r} content parts are not implemented: this model "
                               "reads text only (send parts of type 'text')")


def _check(obj: dict[str, Any], fields: list[Field], body: dict[str, Any], prefix: str) -> None:
    for field in fields:
        if field.name in obj:
            try:
                refused = field.refused(obj[field.name], body)
            except Exception:  # noqa: BLE001 - a value of the wrong type asks for something
                refused = True
            if refused:
                raise _refusal(prefix + field.name, field.why)


def _refusal(param: str, why: str) -> APIError:
    return APIError(400, f"{param}: {why}", "unsupported_parameter", param)
