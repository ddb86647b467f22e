"""The JSON objects of OpenAI's responses, built from engine outputs: envelopes, choices,
usage and log-probabilities (chat's ``{"content": [...]}`` and the legacy completions
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``)."""

from __future__ import annotations

import time
from typing import Any

from slimkv.engine.outputs import RequestOutput, TokenLogprob

LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity


def usage(finals: list[RequestOutput]) -> dict[str, Any]:
    """OpenAI's usage block over a request's choices (the prompt counted once);
    ``cached_tokens`` are prompt tokens served by the prefix cache."""
    first = finals[0]
    completion = sum(out.num_output_tokens for out in finals)
    return {"prompt_tokens": first.num_prompt_tokens, "completion_tokens": completion,
            "total_tokens": first.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": first.num_cached_tokens}}


def response_envelope(request_id: str, obj: str, model: str, choices: list[dict[str, Any]],
                      usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"id": request_id, "object": obj, "created": int(time.time()),
                            "model": model, "choices": choices}
    if usage_ is not None:
        body["usage"] = usage_
    return body


def chat_choice(index: int, text: str | None, finish_reason: str | None,
                logprobs: list[TokenLogprob] | None, *, delta: bool,
                first: bool = False) -> dict[str, Any]:
    """One chat choice: a full ``message`` or a streaming ``delta``."""
    lp = None if logprobs is None else {"content": [_chat_entry(t) for t in logprobs]}
    if not delta:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "finish_reason": finish_reason, "logprobs": lp}
    content: dict[str, str] = {"role": "assistant"} if first else {}
    if text:
        content["content"] = text
    return {"index": index, "delta": content, "finish_reason": finish_reason, "logprobs": lp}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      logprobs: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any]:
    """``offset``: where this text starts in the whole completion (for ``text_offset``)."""
    return {"index": index, "text": text, "finish_reason": finish_reason,
            "logprobs": None if logprobs is None else _completion_logprobs(logprobs, offset)}


def _chat_entry(t: TokenLogprob) -> dict[str, Any]:
    return {**_chat_top(t.token, t.logprob), "top_logprobs": [_chat_top(s, lp) for s, lp in t.top]}


def _chat_top(token: str, logprob: float) -> dict[str, Any]:
    return {"token": token, "logprob": max(logprob, LOGPROB_FLOOR),
            "bytes": list(token.encode("utf-8"))}


def _completion_logprobs(logprobs: list[TokenLogprob], offset: int) -> dict[str, Any]:
    offsets = []
    for t in logprobs:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in logprobs],
            "token_logprobs": [max(t.logprob, LOGPROB_FLOOR) for t in logprobs],
            "top_logprobs": [{t.token: max(t.logprob, LOGPROB_FLOOR),
                              **{s: max(lp, LOGPROB_FLOOR) for s, lp in t.top}}
                             for t in logprobs],
            "text_offset": offsets}
