"""``slimkv bench ab``: one variant against another, in one process, timed in turn.

Two kernel builds (``--builds A B``: directories holding copies of slimkv/kernels' sources,
e.g. ``mkdir /tmp/old && git archive REV slimkv/kernels | tar -x --strip-components=2 -C
/tmp/old``, each optionally ``DIR:-DFLAG...``), compiled here with the package's flags
(:data:`slimkv.kernels.build.FLAGS`) and loaded side by side:

- ``--kernel decode``: ``paged_decode.c`` on the same pools per KV dtype, one decode step
  (every layer) of ``--batch`` sequences x ``--context`` tokens (:func:`~slimkv.bench.kernels
  .decode_setup`), with the largest output difference of B from A;
- ``--kernel prefill``: ``prefill_attention.c`` (``sdpa``: torch's) on one layer's
  attention of a chunk, causal, staged piece by piece and staged in one call
  (:func:`~slimkv.bench.kernels.prefill_cases`);
- ``--kernel engine``: each build's ``paged_decode`` swapped into the engine's one-call
  decode step, blocks of ``--steps`` engine steps per KV dtype.

Or two engine configs (the default without ``--builds``: ``--configs A.yaml B.yaml``, the
embedded default where a file is ``default``, and ``--set-a`` / ``--set-b`` /
``--set KEY=VALUE`` overrides): each engine prefills ``--batch`` sequences x ``--context``
tokens, then blocks of ``--steps`` decode steps run engine after engine, ``--reps`` times.

Every result has both variants' best / median ms and B / A; a build compared with itself
must show a ratio near 1 and an output difference of 0.
"""

from __future__ import annotations

import ctypes
import math
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
import yaml

from slimkv.bench.compare import decode_budget, greedy, prefill_rate
from slimkv.bench.kernels import decode_setup, prefill_cases
from slimkv.bench.timing import dtype_name, environment, interleaved, ratio, summary
from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.backends.cpu_decode import DecodeKernel
from slimkv.kernels.build import FLAGS, compiler, load
from slimkv.kernels.prefill_attn import PrefillKernel
from slimkv.plugins import build_engine
from slimkv.workload import random_prompt

SOURCES = {"decode": "paged_decode.c", "prefill": "prefill_attention.c",
           "engine": "paged_decode.c"}


def build(spec: str, kernel: str, out: Path) -> ctypes.CDLL | None:
    """``spec`` (``DIR[:FLAG...]``) compiled and loaded; None for ``sdpa``. Without flags
    through :func:`slimkv.kernels.build.load` (cached by source text: a copy of the
    package's sources loads the package's library), with flags into ``out``."""
    if spec == "sdpa":
        return None
    source, *flags = spec.split(":")
    path = Path(source).resolve() / SOURCES[kernel]
    if not flags:
        lib = load(path)
        if isinstance(lib, str):
            raise ValueError(f"{spec}: {lib}")
        return lib
    cc = compiler()
    if cc is None:
        raise ValueError("no C compiler ($CC, cc or gcc) to build the kernels with")
    done = subprocess.run([cc, *FLAGS, *flags, str(path), "-o", str(out), "-lm"],
                          capture_output=True, text=True)
    if done.returncode:
        raise ValueError(f"building {spec}: {done.stderr.strip()[-800:]}")
    return ctypes.CDLL(str(out))


def compared(fns: dict[str, Any], reps: int, scale: float = 1.0, diff: bool = False
             ) -> dict[str, Any]:
    """``fns`` (A, B) timed in turn: each one's :func:`summary`, B / A and, with ``diff``,
    the largest difference of B's output from A's."""
    runs = interleaved(fns, reps)
    row: dict[str, Any] = {name: summary(r, scale) for name, r in runs.items()}
    row["b_over_a"] = ratio(row["A"], row["B"])
    if diff:
        a, b = (fns[name]() for name in ("A", "B"))
        row["max_abs_diff"] = float((a.float() - b.float()).abs().max())
    return row


def ab_builds(specs: list[str], kernel: str, kvs: list[str], batch: int, context: int,
              layers: int, tokens: int, reps: int, steps: int, config: Config | None = None
              ) -> dict[str, Any]:
    """Builds A and B of ``kernel`` (see the module doc); results per KV dtype or case.
    ``config``: the engine's (``kernel == "engine"``), whose KV dtype each of ``kvs``
    replaces."""
    env = environment()
    dtype = getattr(torch, env["dtype"])
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        libs = dict(zip("AB", (build(s, kernel, Path(tmp) / f"{n}.so")
                               for n, s in zip("AB", specs))))
        if kernel == "decode":
            kernels = {n: DecodeKernel(lib) for n, lib in libs.items()}
            for kv in kvs:
                step, _ = decode_setup(kv, batch, context, layers, dtype)
                results[kv] = compared({n: lambda k=k: step(k) for n, k in kernels.items()},
                                       reps, diff=True)
        elif kernel == "prefill":
            for n, lib in libs.items():
                if lib is not None and not lib.prefill_attention_native():
                    raise ValueError(f"{dict(zip('AB', specs))[n]}: no AVX512-BF16 here")
            kernels = {n: None if lib is None else PrefillKernel(lib) for n, lib in libs.items()}
            old = [dict(zip("AB", specs))[n] for n, lib in libs.items()
                   if lib is not None and not hasattr(lib, "prefill_attention_staged")]
            for case, run in prefill_cases(tokens, dtype).items():
                if case == "staged_one_call" and old:  # it would go piece by piece there
                    results[case] = {"skipped": f"{old[0]}: no prefill_attention_staged (an "
                                                "older build: its one call read masks)"}
                    continue
                results[case] = compared({n: lambda k=k: run(k) for n, k in kernels.items()},
                                         reps, diff=True)
        else:
            addresses = {n: ctypes.cast(lib.paged_decode, ctypes.c_void_p).value
                         for n, lib in libs.items()}
            for kv in kvs:
                cfg = config.replace("kv_cache", dtype=kv, k_dtype=None, v_dtype=None)
                engine, seqs = decoding(cfg, batch, context, 2 * (reps + 1) * steps)
                lean = engine.runner.lean_step
                if lean is None:
                    raise ValueError(f"{kv}: the engine has no one-call decode step here")
                lean._step = None  # made again by the first one-call step: proof it ran
                results[kv] = compared({n: lambda a=a: swapped_block(engine, a, steps)
                                        for n, a in addresses.items()}, reps, 1 / steps)
                if lean._step is None:
                    raise ValueError(f"{kv}: the engine's one-call decode step did not run")
                results[kv]["attention_paths"] = finished_check(engine, seqs)
    return {"machine": env, "mode": "builds", "kernel": kernel,
            "variants": dict(zip("AB", specs)), "setup": {
                "reps": reps,
                **({"tokens": tokens} if kernel == "prefill" else
                   {"kv_dtypes": kvs, "batch": batch, "context": context}),
                **({"layers": layers} if kernel == "decode" else {}),
                **({"steps_per_block": steps, "unit": "ms per engine step"}
                   if kernel == "engine" else {})},
            "results": results}


def swapped_block(engine: LLMEngine, address: int, steps: int) -> None:
    """``steps`` engine steps with the one-call step's decode attention at ``address``."""
    lean = engine.runner.lean_step
    if lean is None or not lean.available:
        raise ValueError("the engine has no one-call decode step here")
    lean._fns["decode"] = address  # for arguments made later, and in those made already:
    if lean._step is not None:
        lean._step.decode = address
    for _ in range(steps):
        engine.step()


def ab_configs(configs: tuple[Config, Config], labels: list[str], batch: int, context: int,
               reps: int, steps: int) -> dict[str, Any]:
    """The engine decode step of configs A and B (see the module doc)."""
    engines = {n: decoding(c, batch, context, (reps + 1) * steps)
               for n, c in zip("AB", configs)}
    blocks = {n: lambda e=e: [e.step() for _ in range(steps)] for n, (e, _) in engines.items()}
    row = compared(blocks, reps, 1 / steps)
    return {"machine": environment(), "mode": "configs", "variants": dict(zip("AB", labels)),
            "setup": {"batch": batch, "context": context, "reps": reps,
                      "steps_per_block": steps, "unit": "ms per engine step"},
            "engines": {n: {"kv_dtype": e.runner.k_dtype + "/" + e.runner.v_dtype,
                            "model_dtype": dtype_name(e.runner.dtype),
                            "weights": e.runner.weights_class,
                            "attention_paths": finished_check(e, s)}
                        for n, (e, s) in engines.items()},
            "results": {"decode_step": row}}


def engine_with(config: Config, max_seqs: int, max_tokens: int) -> LLMEngine:
    """As :func:`slimkv.bench.compare.engine_for`, the config's KV dtypes kept: a pool for
    ``max_seqs`` x ``max_tokens``, no prefix reuse, first-come-first-served."""
    blocks = max_seqs * math.ceil(max_tokens / config.kv_cache.block_size) + 16
    config = config.replace("kv_cache", num_blocks=blocks, enable_prefix_caching=False,
                            watermark=1.0, max_concurrency_soft=max_seqs)
    return build_engine(config.replace("scheduler", policy="fcfs"))


def decoding(config: Config, batch: int, context: int, steps: int) -> tuple[LLMEngine, list]:
    """An engine whose ``batch`` sequences of ``context`` random tokens are prefilled and
    decoding, with room for ``steps`` more steps before any finishes."""
    new = decode_budget(config.scheduler.max_num_batched_tokens, [batch], context, steps)
    engine = engine_with(config, batch, context + new + 16)
    prefill_rate(engine, 16)  # warm-up: kernels built, allocator primed
    vocab = engine.model_args.vocab_size
    seqs = [engine.add_request(random_prompt(context, vocab, seed=i), greedy(new))
            for i in range(batch)]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    return engine, seqs


def finished_check(engine: LLMEngine, seqs: list) -> dict[str, int]:
    """Raise if a sequence finished inside the measured steps (then fewer were timed);
    else abort them all and return the engine's attention path counts."""
    if any(s.is_finished for s in seqs):
        raise RuntimeError("a sequence finished inside the measured decode steps")
    for s in seqs:
        engine.abort_request(s.request_id)
    return dict(engine.stats().attention_paths)


def with_sets(config: Config, sets: list[str]) -> Config:
    """``config`` with ``SECTION.KEY=VALUE`` overrides (values read as YAML)."""
    for item in sets:
        key, eq, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not (eq and dot):
            raise ValueError(f"--set {item!r}: expected SECTION.KEY=VALUE")
        config = config.replace(section, **{name: yaml.safe_load(value)})
    return config


def load_config(path: str | None, sets: list[str]) -> tuple[Config, str]:
    """A config file (None or ``default``: the embedded one) with overrides, and its label."""
    path = None if path in (None, "default") else path
    label = " ".join([path or "default", *sets])
    return with_sets(Config.load(path), sets), label
