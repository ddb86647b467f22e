"""The JSON objects of OpenAI's responses, built from engine outputs: envelopes, choices,
usage and log-probabilities (chat's ``{"content": [...]}`` and the legacy completions
``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where an echoed prompt's
first token has ``null``s) and vLLM's ``prompt_logprobs``."""

from __future__ import annotations

import time
from typing import Any

from slimkv.engine.outputs import RequestOutput, TokenLogprob
from slimkv.server.scoring import PromptInfo

LOGPROB_FLOOR = -9999.0  # JSON has no -Infinity


def usage(finals: list[RequestOutput], n: int = 1, echo_only: bool = False) -> dict[str, Any]:
    """OpenAI's usage block over a request's choices, ``n`` per prompt in index order (each
    prompt counted once); ``cached_tokens`` are prompt tokens served by the prefix cache.
    ``echo_only``: the token generated past the prompt was not returned, nor is counted."""
    firsts = finals[::n]
    prompt = sum(out.num_prompt_tokens for out in firsts)
    completion = 0 if echo_only else sum(out.num_output_tokens for out in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {
                "cached_tokens": sum(out.num_cached_tokens for out in firsts)}}


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
    """A ``logprob`` of None (an echoed prompt's first token) gives ``null`` entries."""
    offsets = []
    for t in logprobs:
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": [t.token for t in logprobs],
            "token_logprobs": [None if t.logprob is None else max(t.logprob, LOGPROB_FLOOR)
                               for t in logprobs],
            "top_logprobs": [None if t.logprob is None else
                             {t.token: max(t.logprob, LOGPROB_FLOOR),
                              **{s: max(lp, LOGPROB_FLOOR) for s, lp in t.top}}
                             for t in logprobs],
            "text_offset": offsets}


def echo_logprobs(prompt: PromptInfo, k: int) -> list[TokenLogprob]:
    """The prompt's tokens as completion logprob entries with ``k`` alternatives each."""
    texts = prompt.texts
    return [TokenLogprob(texts[token], None, []) if s is None else
            TokenLogprob(texts[token], s.logprob, [(texts[t], lp) for t, lp in s.top[:k]])
            for token, s in zip(prompt.token_ids, prompt.scores)]


def prompt_logprobs(prompt: PromptInfo, k: int) -> list[dict[str, Any] | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else a map from
    token id to ``{logprob, rank, decoded_token}``: the prompt's token, then the ``k``
    most likely (rank: 1 is the most likely)."""
    entries: list[dict[str, Any] | None] = []
    for token, s in zip(prompt.token_ids, prompt.scores):
        if s is None:
            entries.append(None)
            continue
        entry = {str(token): _vllm_logprob(s.logprob, s.rank, prompt.texts[token])}
        for rank, (t, lp) in enumerate(s.top[:k], 1):
            entry.setdefault(str(t), _vllm_logprob(lp, rank, prompt.texts[t]))
        entries.append(entry)
    return entries


def _vllm_logprob(logprob: float, rank: int, text: str) -> dict[str, Any]:
    return {"logprob": max(logprob, LOGPROB_FLOOR), "rank": rank, "decoded_token": text}
