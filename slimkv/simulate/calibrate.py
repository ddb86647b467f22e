"""Calibrate the step-time model on this CPU before trusting it anywhere else.

The real engine (the embedded model) serves the token-level long-session workload at one
capacity level while every step's batch and wall time are recorded (:class:`RealEngine`).
The CPU's four constants (overhead, per-sequence cost, bandwidth, FLOP rate) are fitted to
one level's steps by non-negative least squares on relative error; then the simulator,
with the fitted model, replays *another* level and its decode steps and TTFT are compared
with the measured ones: the error the report quotes is that held-out error.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from slimkv.config import Config
from slimkv.engine.llm_engine import LLMEngine
from slimkv.plugins import build_engine
from slimkv.simulate.costs import Device, ModelCost, StepModel
from slimkv.simulate.engine import Batch, Finished, SimEngine, StepRecord
from slimkv.simulate.run import LevelResult, run_level
from slimkv.simulate.workload import SessionSpec


class RealEngine:
    """``LLMEngine`` behind the simulator's interface, on the wall clock."""

    def __init__(self, config: Config) -> None:
        self.engine = build_engine(config)
        self.scheduler, self.pool = self.engine.scheduler, self.engine.pool
        self._batch: Batch | None = None
        execute = self.engine.runner.execute

        def spy(scheduled):
            self._batch = Batch(tuple(n for _, n in scheduled),
                                tuple(s.num_computed_tokens for s, _ in scheduled),
                                sum(s.num_computed_tokens + n == s.num_tokens
                                    for s, n in scheduled))
            return execute(scheduled)

        self.engine.runner.execute = spy

    @property
    def now(self) -> float:
        return time.monotonic()

    @property
    def requests(self):
        return self.engine.requests

    def add_request(self, prompt, params, request_id, session_id):
        return self.engine.add_request(prompt, params, request_id, session_id)

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()

    def idle_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now))

    def step(self) -> tuple[StepRecord, list[Finished]]:
        seqs = dict(self.engine.requests)
        self._batch = None
        t0 = time.monotonic()
        outputs = self.engine.step()
        now = time.monotonic()
        record = StepRecord(self.engine.num_steps, duration=now - t0, batch=self._batch)
        record.num_tokens = self._batch.num_tokens if self._batch else 0
        finished = []
        for o in outputs:
            if o.finished:
                seq = seqs[o.request_id]
                finished.append(Finished(o.request_id, o.token_ids, seq.arrival_time,
                                         seq.first_token_time, now, o.num_output_tokens,
                                         o.num_cached_tokens))
        return record, finished


def cpu_cost(runner) -> ModelCost:
    """The engine's own cost terms: its model's shapes, the bytes its weights really take
    (the weights class it loaded) and its resolved K and V dtypes."""
    kv = runner.config.kv_cache
    return ModelCost.of(runner.model_args, runner.memory_split()["weights"], runner.k_dtype,
                        runner.v_dtype, kv.k_scale, kv.block_size)


FEATURES = ("steps", "sequences", "bytes", "linear_flops", "attention_pairs")


def features(batch: Batch, cost: ModelCost) -> list[float]:
    return [1.0, len(batch.new_tokens), cost.step_bytes(batch), cost.linear_flops(batch),
            cost.step_pairs(batch)]


def fit_cpu(steps: list[StepRecord], cost: ModelCost) -> Device:
    """Non-negative least squares, rows weighted by 1/t (relative error), of
    ``t = overhead + per_seq * seqs + bytes / BW + linear FLOPs / F + pairs * attn``."""
    rows = [s for s in steps if s.batch is not None]
    X = np.array([features(s.batch, cost) for s in rows])
    y = np.array([s.duration for s in rows])
    w = 1.0 / y
    active = list(range(X.shape[1]))
    coef = np.zeros(X.shape[1])
    while active:
        sol, *_ = np.linalg.lstsq(X[:, active] * w[:, None], y * w, rcond=None)
        if (sol >= 0).all():
            coef[:] = 0
            coef[active] = sol
            break
        active.pop(int(np.argmin(sol)))
    inv_bw, inv_f = coef[2], coef[3]
    return Device("cpu (fitted)", hbm_gbps=1 / inv_bw / 1e9 if inv_bw else 1e9,
                  bf16_tflops=1 / inv_f / 1e12 if inv_f else 1e9, memory_gb=0, bw_eff=1.0,
                  flop_eff=1.0, overhead_s=float(coef[0]), per_seq_s=float(coef[1]),
                  overlap=False, attn_s_per_pair=float(coef[4]))


def step_error(steps: list[StepRecord], model: StepModel) -> dict[str, float]:
    """Median and P90 of |predicted - measured| / measured over decode steps and all steps."""
    def stats(sel):
        err = sorted(abs(model(s.batch) - s.duration) / s.duration for s in sel)
        return {"median": round(err[len(err) // 2], 4), "p90": round(err[int(0.9 * len(err))], 4),
                "n": len(err)} if err else {}
    with_batch = [s for s in steps if s.batch is not None]
    return {"decode": stats([s for s in with_batch if s.is_decode]), "all": stats(with_batch)}


def calibrate(config: Config, spec: SessionSpec, fit_levels: tuple[int, ...],
              test_level: int, duration: float) -> dict[str, Any]:
    """Measure each of ``fit_levels`` and ``test_level`` on the real engine, fit on the
    first ones' steps together (one level alone holds the batch size fixed, so it cannot
    tell the per-step from the per-sequence cost), predict the last with the simulator
    (same config, same pool)."""
    measured: dict[int, LevelResult] = {}
    for level in (*fit_levels, test_level):
        real = RealEngine(config)
        run_level(real, spec, 2, 2.0)                 # warm the kernels up
        real = RealEngine(config)
        cost = cpu_cost(real.engine.runner)
        measured[level] = run_level(real, spec, level, duration, keep_steps=True)
        pool_blocks, soft = real.pool.num_blocks, real.engine.runner.num_staging_slots
    fit_steps = [s for level in fit_levels for s in measured[level].steps]
    dev = fit_cpu(fit_steps, cost)
    model = StepModel(dev, cost)
    sim = SimEngine(config.kv_cache, config.scheduler, pool_blocks, spec.context, model, soft)
    predicted = run_level(sim, spec, test_level, duration, keep_steps=True)
    return {"kv_dtype": config.kv_cache.dtype, "fit_level": "+".join(map(str, fit_levels)),
            "test_level": test_level, "duration_s": duration, "num_blocks": pool_blocks,
            "fitted": {"overhead_ms": round(dev.overhead_s * 1e3, 3),
                       "per_seq_ms": round(dev.per_seq_s * 1e3, 3),
                       "bandwidth_gbps": round(dev.hbm_gbps, 2),
                       "tflops": round(dev.bf16_tflops, 4),
                       "attn_ns_per_pair": round(dev.attn_s_per_pair * 1e9, 4)},
            "raw_steps": {level: [[*features(s.batch, cost), s.duration]
                                  for s in measured[level].steps if s.batch is not None]
                          for level in measured},
            "raw_columns": [*FEATURES, "seconds"],
            "step_error_fit": step_error(fit_steps, model),
            "step_error_test": step_error(measured[test_level].steps, model),
            "measured": measured[test_level].summary(), "predicted": predicted.summary()}
