"""Timing helpers shared by ``slimkv bench kernels`` and ``slimkv bench ab``.

This host's speed drifts between minutes (a shared VM), so variants compared with each
other are never timed one after the other: :func:`interleaved` calls each variant once per
round, round after round, and :func:`summary` keeps the best and the median of the rounds.
:func:`environment` is what every result records about the host.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from slimkv.bench.compare import take_turns
from slimkv.bench.engine import machine_info


def ms_of(fn: Callable[[], Any], calls: int = 1) -> float:
    """Wall milliseconds per call of ``calls`` calls of ``fn``."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return 1000 * (time.perf_counter() - start) / calls


def interleaved(fns: dict[str, Callable[[], Any]], reps: int, calls: int = 1
                ) -> dict[str, list[float]]:
    """Ms per call of every ``fns`` entry: each called once to warm up, then ``reps`` rounds
    in which each runs ``calls`` times in turn (host noise hits them alike)."""
    for fn in fns.values():
        fn()
    return take_turns(reps, {name: lambda rep, fn=fn: ms_of(fn, calls)
                             for name, fn in fns.items()})


def summary(runs: list[float], scale: float = 1.0) -> dict[str, Any]:
    """Best and median of ``runs`` (ms, times ``scale``) and the runs themselves."""
    runs = [scale * r for r in runs]
    return {"best_ms": round(min(runs), 4), "median_ms": round(statistics.median(runs), 4),
            "runs_ms": [round(r, 4) for r in runs]}


def ratio(base: dict[str, Any], other: dict[str, Any]) -> dict[str, float]:
    """``other`` / ``base`` of two :func:`summary` results, best and median."""
    return {k.removesuffix("_ms"): round(other[k] / base[k], 4) if base[k] else float("nan")
            for k in ("best_ms", "median_ms")}


def environment(dtype: torch.dtype | None = None) -> dict[str, Any]:
    """The host (:func:`~slimkv.bench.engine.machine_info`: CPU model, ISA flags, threads),
    the model dtype ``model.dtype: auto`` picks here and the one measured (``dtype``, else
    the same), and why any native kernel is missing."""
    from slimkv.backends.cpu_kv import kv_blocks_unavailable_reason
    from slimkv.engine.runner import resolve_dtype
    from slimkv.backends.cpu_decode import kernel_unavailable_reason
    from slimkv.kernels.prefill_attn import prefill_kernel_unavailable_reason
    from slimkv.kernels.qgemm import qgemm_unavailable_reason

    auto = resolve_dtype("auto", torch.device("cpu"))
    missing = {"decode": kernel_unavailable_reason(), "qgemm": qgemm_unavailable_reason(),
               "prefill": prefill_kernel_unavailable_reason(),
               "kv_blocks": kv_blocks_unavailable_reason()}
    return {**machine_info(), "model_dtype_auto": dtype_name(auto),
            "dtype": dtype_name(dtype or auto),
            "kernels_missing": {k: v for k, v in missing.items() if v}}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
