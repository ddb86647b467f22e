"""What an HTTP handler asks a backend for (one prompt; a list of prompts is one request
each), and how its prompt becomes token ids."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slimkv.engine.outputs import RequestOutput
from slimkv.engine.sampling import SamplingParams
from slimkv.model.protocol import Tokenizer
from slimkv.server.errors import APIError
from slimkv.server.scoring import PromptInfo

Messages = list[dict[str, Any]]
Item = RequestOutput | APIError


@dataclass(slots=True)
class GenerateRequest:
    """What a handler asks for. Tokenizing happens on the engine thread (the tokenizer is
    not shared across threads); ``make_params`` gets the prompt length, so the default
    ``max_tokens`` can depend on the room left in the context window.

    ``echo`` and ``prompt_logprobs`` (top alternatives per prompt token, or None) ask the
    backend for :attr:`prompt_info`, set before the request's first output arrives."""

    request_id: str
    prompt: str | list[int] | Messages
    chat: bool
    make_params: Callable[[int], SamplingParams]
    session_id: str | None = None
    template: dict[str, Any] = field(default_factory=dict)  # apply_chat_template's options
    tools: list[dict] | None = None            # OpenAI tool definitions for the template
    add_special_tokens: bool = True            # a text prompt's BOS/EOS, as its tokenizer adds
    echo: bool = False
    prompt_logprobs: int | None = None
    prompt_info: PromptInfo | None = None
    replica: str | None = None                 # the cluster replica serving it (a header)
    prompt_ids: list[int] | None = None        # set on the engine thread when admitted
    params: SamplingParams | None = None
    loop: asyncio.AbstractEventLoop | None = None  # set by AsyncEngine.generate
    queue: asyncio.Queue[Item] | None = None
    num_finished: int = 0                      # of its n choices

    @property
    def wants_prompt(self) -> bool:
        return self.echo or self.prompt_logprobs is not None

    def finishes(self, out: RequestOutput) -> bool:
        """Count a finished choice; True when this output ends the whole request."""
        self.num_finished += out.finished
        return self.num_finished >= (self.params.n if self.params else 1)

    def deliver(self, item: Item) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


def prompt_ids(tokenizer: Tokenizer, request: GenerateRequest) -> list[int]:
    """The request's prompt as token ids (a chat through the model's template)."""
    if request.chat:
        return tokenizer.apply_chat_template(request.prompt, request.tools, **request.template)
    if isinstance(request.prompt, str):
        return tokenizer.encode(request.prompt, request.add_special_tokens)
    return list(request.prompt)
