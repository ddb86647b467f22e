"""Per-token cost of JSON-schema token masks on this CPU: llguidance (what slimkv uses,
through slimkv.options.structured.Grammars) and, when importable, xgrammar (for the choice).

Each of B rows follows the grammar with random allowed tokens (argmax of masked noise);
a step fills the masks of all rows, applies them to [B, vocab] float32 logits and
advances the matchers. Writes bench/results/grammar.json. Run quiet, under the CPU lock:
  flock /tmp/slimkv-cpu.lock .venv/bin/python scripts/bench_grammar.py
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from contextlib import suppress
from importlib.metadata import PackageNotFoundError, version

import torch

from slimkv.bench.engine import machine_info
from slimkv.model_io.loader import load_tokenizer
from slimkv.options.structured import Grammars, canonical_schema

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3,
                                  "items": {"enum": ["a", "b", "c"]}}}}
STEPS = 48
BATCHES = (1, 16)


def measure(library: str, compile_s: float, matchers: list, vocab: int, eos: set[int],
            step: Callable[[torch.Tensor], list[int]], stopped: Callable) -> dict:
    """Time ``step(logits) -> tokens`` (mask, pick, advance the matchers) over STEPS random
    [rows, vocab] logits, one row a matcher; a row that ends (EOS or ``stopped``) restarts."""
    batch = len(matchers)
    gen = torch.Generator().manual_seed(0)
    elapsed = 0.0
    for _ in range(STEPS):
        logits = torch.randn(batch, vocab, generator=gen)
        start = time.perf_counter()
        tokens = step(logits)
        elapsed += time.perf_counter() - start
        for m, t in zip(matchers, tokens):
            if t in eos or stopped(m):
                m.reset()
    return {"library": library, "batch": batch, "compile_s": round(compile_s, 4),
            "step_ms": round(1e3 * elapsed / STEPS, 3),
            "per_token_ms": round(1e3 * elapsed / STEPS / batch, 3)}


def run_llguidance(tok, vocab: int, batch: int) -> dict:
    grammars = Grammars(tok.hf, list(tok.eos_token_ids), vocab)
    schema = canonical_schema(SCHEMA)
    start = time.perf_counter()
    grammars.matcher(schema)
    compile_s = time.perf_counter() - start
    matchers = [grammars.matcher(schema) for _ in range(batch)]
    rows = list(range(batch))

    def step(logits: torch.Tensor) -> list[int]:
        grammars.mask_(logits, rows, matchers)
        tokens = logits.argmax(-1).tolist()
        Grammars.advance(matchers, tokens)
        return tokens

    return measure("llguidance", compile_s, matchers, vocab, set(tok.eos_token_ids), step,
                   lambda m: m.is_stopped())


def run_xgrammar(tok, vocab: int, batch: int) -> dict | None:
    try:
        import xgrammar as xgr
    except ImportError:
        return None
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=vocab,
                                              stop_token_ids=sorted(tok.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    start = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - start
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)

    def step(logits: torch.Tensor) -> list[int]:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        tokens = logits.argmax(-1).tolist()
        for m, t in zip(matchers, tokens):
            m.accept_token(t)
        return tokens

    return measure("xgrammar", compile_s, matchers, vocab, set(tok.eos_token_ids), step,
                   lambda m: m.is_terminated())


def main() -> None:
    tok = load_tokenizer(None)
    vocab = tok.vocab_size
    results = []
    for batch in BATCHES:
        for run in (run_llguidance, run_xgrammar):
            row = run(tok, vocab, batch)
            if row:
                results.append(row)
                print(row)
    versions = {}
    for lib in ("llguidance", "xgrammar"):
        with suppress(PackageNotFoundError):
            versions[lib] = version(lib)
    out = {"machine": machine_info(),
           "vocab": vocab, "steps": STEPS, "schema": SCHEMA, "versions": versions,
           "results": results}
    with open("bench/results/grammar.json", "w") as f:
        json.dump(out, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
