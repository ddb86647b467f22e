"""Structured output: JSON-schema and Lark grammars (llguidance) and their batched token masks.

A grammar is compiled once (:meth:`Grammars.matcher` keeps the compiled matcher of the
last :data:`CACHE_SIZE` grammars, keyed by the schema's canonical JSON or the Lark text:
tool calling's grammars, :mod:`slimkv.options.tool_calls`) and every request
gets a copy of it that tracks its own output. Each step, the masks of all constrained rows
are computed in one parallel call (``fill_next_token_bitmask_par``) into one int32
bitmask, unpacked with tensor ops and applied to the logits in place.

Why llguidance, not xgrammar (``scripts/bench_grammar.py`` -> ``bench/results/grammar.json``,
Intel Xeon, 2 threads): xgrammar 0.2.9 masks a token 10-25% cheaper (0.36-0.43 ms vs
0.40-0.57 ms; a single-stream decode step is ~25 ms) and compiles a schema in 0.01 s vs
0.44-0.54 s (paid once per schema here: the cache), but it pulls in apache-tvm-ffi, triton
and an unpinned torch requirement, where llguidance is one self-contained wheel.
"""

from __future__ import annotations

import json
from collections import OrderedDict

import llguidance
import llguidance.hf
import torch

from slimkv.engine.sampling import LogitsProcessor, SampledToken
from slimkv.engine.sequence import Sequence

CACHE_SIZE = 64
JSON_OBJECT_SCHEMA = {"type": "object"}  # response_format {"type": "json_object"}


def canonical_schema(schema: dict | bool) -> str:
    return json.dumps(schema, sort_keys=True, separators=(",", ":"))


def schema_error(schema: str) -> str | None:
    """Why the JSON schema (a JSON string) cannot be compiled, or None if it can."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
    except ValueError as exc:
        return str(exc)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    return error or None


class Grammars:
    """The tokenizer-bound side: compiled matchers per schema and the batched masks."""

    def __init__(self, hf_tokenizer, eos_token_ids: list[int], vocab_size: int) -> None:
        self._hf = hf_tokenizer
        self._eos = sorted(eos_token_ids)
        self.vocab_size = vocab_size
        self._tokenizer: llguidance.LLTokenizer | None = None  # built on first use (~1 s)
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[tuple[str | None, str | None], llguidance.LLMatcher] = (
            OrderedDict())
        self.num_compiled = 0

    def matcher(self, schema: str | None = None, lark: str | None = None
                ) -> llguidance.LLMatcher:
        """A fresh matcher for a JSON ``schema`` or a ``lark`` grammar; ``ValueError`` if
        it is invalid."""
        key = (schema, lark)
        compiled = self._compiled.get(key)
        if compiled is None:
            compiled = self._compile(schema) if lark is None else self._compile_lark(lark)
            self._compiled[key] = compiled
            if len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        self._compiled.move_to_end(key)
        return compiled.deep_copy()

    def _compile_lark(self, lark: str) -> llguidance.LLMatcher:
        try:
            grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        except ValueError as exc:
            raise ValueError(f"tools: cannot build the tool-call grammar: {exc}") from exc
        return self._matcher(grammar, "tools: cannot build the tool-call grammar")

    def _compile(self, schema: str) -> llguidance.LLMatcher:
        error = schema_error(schema)
        if error:
            raise ValueError(f"response_format: invalid JSON schema: {error}")
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False})
        return self._matcher(grammar, "response_format: invalid JSON schema")

    def _matcher(self, grammar: str, what: str) -> llguidance.LLMatcher:
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                           eos_token=self._eos)
            self._executor = llguidance.LLExecutor()
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{what}: {matcher.get_error()}")
        self.num_compiled += 1
        return matcher

    def mask_(self, logits: torch.Tensor, rows: list[int],
              matchers: list[llguidance.LLMatcher]) -> None:
        """Set to -inf every token the grammar forbids, in the given rows of ``logits``."""
        # Imported here: its torch.compile decorator imports torch._dynamo (~1 s of every
        # process start, though only a request with a grammar needs it).
        import llguidance.torch

        bitmask = llguidance.torch.allocate_token_bitmask(len(rows), self.vocab_size)
        llguidance.torch.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask)
        bits = torch.arange(32, dtype=torch.int32)
        allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).flatten(1)[:, :logits.shape[1]].bool()
        dead_ends = (~allowed.any(1)).nonzero()  # a matcher in error allows nothing: end it
        allowed[dead_ends, torch.tensor(self._eos)] = True
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed.to(logits.device),
                                                  float("-inf"))

    @staticmethod
    def advance(matchers: list[llguidance.LLMatcher], tokens: list[int]) -> None:
        for matcher, token in zip(matchers, tokens):
            matcher.consume_token(token)


class StructuredOutput(LogitsProcessor):
    """``json_schema`` and ``grammar``: each request's matcher (``seq.matcher``), made when
    it is added; the forbidden tokens of every constrained row masked each step; the drawn
    ones consumed."""

    options = frozenset({"json_schema", "grammar"})

    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars

    def wants(self, seq: Sequence) -> bool:
        return seq.matcher is not None

    def add(self, seq: Sequence) -> None:
        if seq.params.grammar is not None:
            seq.matcher = self.grammars.matcher(lark=seq.params.grammar)
        elif seq.params.json_schema is not None:
            seq.matcher = self.grammars.matcher(seq.params.json_schema)

    def apply(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [row for row, s in enumerate(seqs) if s.matcher is not None]
        self.grammars.mask_(logits, rows, [seqs[row].matcher for row in rows])

    def accept(self, seqs: list[Sequence], sampled: list[SampledToken]) -> None:
        pairs = [(s.matcher, t.token_id) for s, t in zip(seqs, sampled) if s.matcher is not None]
        Grammars.advance(*map(list, zip(*pairs)))
