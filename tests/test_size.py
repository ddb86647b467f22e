"""The serving core stays small enough to read in a sitting: under 3,000 lines of code in
all and no module of the package over 300 lines (what counts as the core: docs/architecture.md);
the plug-ins stay outside it because the core never imports them."""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "slimkv"
CORE_BUDGET, MODULE_MAX = 3000, 300
# The path one request takes through one engine (issue 19: model, kv, attention, kernels glue,
# scheduler, engine/runner, sequence, sampling, outputs, config): config and defaults,
# bookkeeping, the sampler with its logits-processor protocol and n choices, outputs and the
# detokenizer, the model, its quantized weights and its loader protocol, the KV pool, its
# formats and its connector protocol, attention (its interface, the step's metadata, the
# SDPA and reference backends) and the kernel glue, start-up memory, the runner, the engine
# and its stats snapshot. The kernels count by their Python glue (kernels/*.py: ctypes
# wrappers); their sources, the C files and the Triton kernels of kernels/triton/, are
# outside the budget, as are the kernel backends of attention (slimkv/backends: the CPU
# backend with its one-call decode step, the Triton backend), plug-ins the builder passes.
# So are the tools' config sections, which live with the tools (slimkv/server/config.py,
# slimkv/cluster/config.py) and register with slimkv/config.py.
CORE = ["config.py", "stats.py", "engine/*.py", "model/*.py", "kv/*.py", "attention/*.py",
        "kernels/*.py"]
# Plug-ins: the core calls them through a protocol (kv/connector.py's KVConnector,
# engine/sampling.py's LogitsProcessor, model/protocol.py's ModelLoader, the KV manager's
# interface, attention's backend interface) and never imports them; slimkv/plugins.py builds
# engines with them. The offload tier, the OpenAI sampling options (logprobs, penalties,
# logit_bias, min_tokens, structured output), the model files (GGUF / Hugging Face
# checkpoints, the tokenizer), the contiguous baseline (kv_cache.paged: false) and the
# kernel backends of attention.
PLUGINS = ("slimkv.kv.offload", "slimkv.options", "slimkv.model_io", "slimkv.kv.contiguous",
           "slimkv.backends")


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def code_lines(path: Path) -> int:
    """Lines holding code: not blank, not only a comment, not part of a module's, class's or
    function's docstring. A statement over several lines counts each of them."""
    source = path.read_text()
    docstrings = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            first = node.body[0] if node.body else None
            if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                    and isinstance(first.value.value, str)):
                docstrings.update(range(first.lineno, first.end_lineno + 1))
    layout = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
              tokenize.ENDMARKER)
    code = {line for token in tokenize.generate_tokens(io.StringIO(source).readline)
            if token.type not in layout for line in range(token.start[0], token.end[0] + 1)}
    return len(code - docstrings)


def core_files() -> list[Path]:
    return sorted({path for pattern in CORE for path in PACKAGE.glob(pattern)})


def imported_names(path: Path) -> set[str]:
    """Every module an import statement names, anywhere in the file (top level, functions,
    ``TYPE_CHECKING``), with the names ``from x import`` takes (``x.y``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_the_core_list_names_modules_that_exist() -> None:
    for pattern in CORE:
        assert list(PACKAGE.glob(pattern)), pattern


def test_no_core_module_imports_a_plugin() -> None:
    """Not by an import statement, nor by name at run time (``import_module``,
    ``__import__``), nor through the builder that does (slimkv.plugins)."""
    reaching = {}
    for path in core_files():
        tree = ast.parse(path.read_text())
        bad = sorted(n for n in imported_names(path)
                     if n.startswith(PLUGINS) or n.startswith("slimkv.plugins"))
        bad += [f"{name}()" for node in ast.walk(tree) if isinstance(node, ast.Call)
                for name in [getattr(node.func, "attr", getattr(node.func, "id", None))]
                if name in ("import_module", "__import__")]
        if bad:
            reaching[str(path.relative_to(PACKAGE))] = bad
    assert not reaching, reaching


def test_the_serving_core_is_under_its_budget() -> None:
    """Code lines (:func:`code_lines`), so that documenting the core costs nothing."""
    counts = {str(p.relative_to(PACKAGE)): code_lines(p) for p in core_files()}
    total = sum(counts.values())
    table = "\n".join(f"{n:5d} {name}" for name, n in sorted(counts.items(), key=lambda i: -i[1]))
    assert total < CORE_BUDGET, f"serving core: {total} code lines (budget {CORE_BUDGET})\n{table}"


def test_no_module_is_over_300_lines() -> None:
    big = {str(p.relative_to(PACKAGE)): lines(p) for p in PACKAGE.rglob("*.py")
           if lines(p) > MODULE_MAX}
    assert not big, big


def test_an_engine_takes_its_plugins_from_the_builder() -> None:
    """Without slimkv.plugins.build_engine, an engine has no model loader, nor the
    contiguous baseline a ``paged: false`` config asks for: it says so before loading."""
    from slimkv.config import Config, ConfigError
    from slimkv.engine.llm_engine import LLMEngine

    with pytest.raises(TypeError, match=r"slimkv\.plugins\.build_engine"):
        LLMEngine(Config())
    with pytest.raises(ConfigError, match="kv_cache.paged: false"):
        LLMEngine(Config().replace("kv_cache", paged=False), loader=lambda *args: 1 / 0)
