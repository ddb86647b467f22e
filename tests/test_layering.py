"""Imports point down: every module imports, the package has no import cycle, the serving
core never reaches up into the tools (server, bench, eval, CLI...), and each core layer
imports only layers below it. Imports are read from the source (AST), wherever they stand
in a module: top level, inside functions, or under ``TYPE_CHECKING``."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "slimkv"

# The serving core, bottom-up; a module may import its own layer and the layers below.
CORE_LAYERS = [
    ["slimkv.config", "slimkv.stats", "slimkv.engine", "slimkv.attention",
     "slimkv.engine.engine_stats"],
    ["slimkv.kernels.build", "slimkv.kernels.qgemm", "slimkv.kernels.tile_gemm"],
    ["slimkv.model", "slimkv.engine.sampling_params", "slimkv.engine.sampling", "slimkv.engine.choices", "slimkv.kv.quant",
     "slimkv.kv.block_scales", "slimkv.kv.layers", "slimkv.kv.block_pool", "slimkv.kv.connector",
     "slimkv.engine.sequence",
     "slimkv.kv.manager", "slimkv.engine.outputs"],
    ["slimkv.kv.cache", "slimkv.kv.staging", "slimkv.kv", "slimkv.kernels"],
    ["slimkv.attention.prefill", "slimkv.attention.metadata", "slimkv.attention.backend",
     "slimkv.attention.reference", "slimkv.attention.sdpa", "slimkv.attention.layer"],
    ["slimkv.engine.scheduler", "slimkv.engine.memory", "slimkv.engine.step_inputs"],
    ["slimkv.engine.runner"],
    ["slimkv.engine.llm_engine"],
    # Plug-ins: the core calls them through a protocol and never imports them; they import
    # the core below the engine, and the engine's builder (slimkv.plugins) imports them.
    ["slimkv.kv.offload", "slimkv.options", "slimkv.model_io", "slimkv.kv.contiguous",
     "slimkv.backends"],
    ["slimkv.llm", "slimkv.plugins", "slimkv.workload", "slimkv",
     # The tools' config sections, which the package imports to register them with Config
     # (they import slimkv.config only).
     "slimkv.server.config", "slimkv.cluster.config"],
]
# Modules that plan, bench, serve or verify: above the core.
TOOLS = ("slimkv.server", "slimkv.cluster", "slimkv.bench", "slimkv.eval", "slimkv.loadtest",
         "slimkv.cli", "slimkv.profile_cli", "slimkv.verify", "slimkv.planner",
         "slimkv.simulate")
# The block bookkeeping a simulator drives without a model: it must not need torch.
TORCH_FREE = ("slimkv.engine.scheduler", "slimkv.kv.manager", "slimkv.kv.block_pool",
              "slimkv.kv.contiguous", "slimkv.engine.sequence", "slimkv.config")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> set[str]:
    """The slimkv modules ``name`` imports (``from slimkv.x import y`` counts ``slimkv.x.y``
    when that is a module, else ``slimkv.x``)."""
    tree = ast.parse(MODULES[name].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES
                      else node.module for a in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports_of(name) for name in MODULES}


def layer_of(name: str) -> int | None:
    """The layer of the longest entry naming ``name`` or a package above it."""
    found = [(len(p), rank) for rank, layer in enumerate(CORE_LAYERS) for p in layer
             if name == p or (p != "slimkv" and name.startswith(p + "."))]
    return max(found)[1] if found else None


@pytest.mark.parametrize("name", sorted(MODULES))
def test_every_module_imports(name: str) -> None:
    importlib.import_module(name)


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, path + [dep])
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name, [name])


def test_core_never_imports_the_tools_and_layers_point_down() -> None:
    upward = []
    for name, deps in GRAPH.items():
        rank = layer_of(name)
        if rank is None:
            assert name.startswith(TOOLS), f"{name}: not placed in a core layer or the tools"
            continue
        for dep in deps:
            dep_rank = layer_of(dep)
            if dep_rank is None or dep_rank > rank:
                upward.append(f"{name} -> {dep}")
    assert not upward, "imports reaching up: " + ", ".join(sorted(upward))


def test_block_bookkeeping_imports_without_torch() -> None:
    code = ("import sys\n" + "".join(f"import {m}\n" for m in TORCH_FREE)
            + "print('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_the_server_reads_engine_stats_not_engine_internals() -> None:
    """Server modules (one engine's, and a cluster's replicas and router) see the engine
    through ``stats()``, ``block_map()`` and its request API, never its scheduler, pool,
    manager or runner."""
    internals = {"scheduler", "pool", "manager", "runner", "attention", "cache"}
    reads = [f"{path.parent.name}/{path.name}:{node.lineno} .{node.attr}"
             for package in ("server", "cluster")
             for path in sorted((PACKAGE / package).glob("*.py"))
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in internals
             and not (isinstance(node.value, ast.Attribute) and node.value.attr == "config")]
    assert not reads, reads


def test_nothing_imports_the_simulator_but_its_cli():
    users = sorted(name for name, deps in GRAPH.items()
                   if any(d.startswith("slimkv.simulate") for d in deps)
                   and not name.startswith("slimkv.simulate") and name != "slimkv.bench.simulate_cli")
    assert not users, users
