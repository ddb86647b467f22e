"""The OpenAI sampling options as logits processors (:class:`slimkv.engine.sampling.LogitsProcessor`):
plug-ins the core calls but never imports. :func:`slimkv.plugins.build_engine` hands the
engine :func:`logits_processors`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from slimkv.options.logprobs import Logprobs
from slimkv.options.penalties import Penalties
from slimkv.options.structured import Grammars, StructuredOutput
from slimkv.engine.sampling import LogitsProcessor

if TYPE_CHECKING:
    from slimkv.engine.runner import ModelRunner


def logits_processors(runner: ModelRunner) -> list[LogitsProcessor]:
    """The processors for a runner's model, in the order they see the logits: raw logprobs
    first, then ``min_tokens``, bias and penalties, then the grammar masks."""
    tokenizer = runner.tokenizer
    grammars = Grammars(tokenizer.hf, list(tokenizer.eos_token_ids), runner.model_args.vocab_size)
    return [Logprobs(), Penalties(tokenizer.eos_token_ids), StructuredOutput(grammars)]
