"""Capacity planner: exact KV arithmetic, the sessions table, errors, and agreement with the engine."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slimkv.config import Config, ConfigError
from slimkv.planner import (KVRow, Plan, builtin_models, load_hf_config, model_weight_bytes,
                            parse_bytes, plan, planning_args)

KiB, GiB = 2**10, 2**30


def _row(p: Plan, kv_dtype: str) -> KVRow:
    return next(r for r in p.rows if r.kv_dtype == kv_dtype)


@pytest.fixture(scope="module")
def llama3() -> Plan:
    return plan("llama-3.1-8b", 80 * GiB, context=32768, sessions=48, k_scale="per_token")


def test_builtin_models_shipped() -> None:
    assert {"llama-2-7b", "llama-3.1-8b", "qwen2.5-7b", "mistral-7b", "smollm2-135m"} <= set(builtin_models())


def test_kv_bytes_per_token(llama3: Plan) -> None:
    # 32 layers x 32 KV heads x head 128 x (K, V) x 2 bytes
    assert _row(plan("llama-2-7b", 80 * GiB), "float16").bytes_per_token == 512 * KiB
    assert _row(llama3, "bfloat16").bytes_per_token == 128 * KiB          # 8 KV heads
    # int8: half, plus one float16 scale per token, layer, KV head, K and V
    assert _row(llama3, "int8").bytes_per_token == 128 * KiB // 2 + 32 * 8 * 2 * 2


def test_sessions_table_follows_from_the_budget(llama3: Plan) -> None:
    p = llama3
    assert p.kv_budget == 80 * GiB - p.weights - p.activation_reserve
    for r in p.rows:
        assert r.num_blocks == p.kv_budget // (p.block_size * r.bytes_per_token)
        assert r.max_sessions == r.num_blocks // (32768 // p.block_size)
        assert r.context_at_sessions == r.num_blocks // 48 * p.block_size
    assert _row(p, "int8").max_sessions >= 2 * _row(p, "bfloat16").max_sessions - 1


def test_weights_scale_with_dtype() -> None:
    args = planning_args(load_hf_config("llama-2-7b")[1])
    assert model_weight_bytes(args, torch.float32) == 2 * model_weight_bytes(args, torch.bfloat16)


def test_impossible_budget_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="does not fit in 8.0 GiB.*weights take"):
        plan("llama-3.1-8b", 8 * GiB)


def test_bad_configs_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="built-in: .*llama-2-7b"):
        plan("no-such-model", 80 * GiB)
    broken = tmp_path / "config.json"
    broken.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        plan(str(tmp_path), 80 * GiB)
    _, cfg = load_hf_config("llama-2-7b")
    del cfg["num_hidden_layers"]
    broken.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="missing key 'num_hidden_layers'"):
        plan(str(broken), 80 * GiB)
    with pytest.raises(ValueError, match="unknown weight dtype"):
        plan("llama-2-7b", 80 * GiB, weight_dtype="int3")


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 * GiB
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1.5") == int(1.5 * GiB)
    with pytest.raises(ValueError, match="cannot read memory size"):
        parse_bytes("lots")


@pytest.mark.slow
def test_plan_matches_the_engine_for_smollm2() -> None:
    from slimkv.plugins import build_engine

    # Unquantized weights (a pinned model dtype); the quantized classes: the test below.
    config = Config.from_dict({"kv_cache": {"memory_gb": 0.125}, "model": {"dtype": "float32"}})
    engine = build_engine(config)
    split = engine.memory_split()
    p = plan("smollm2-135m", split["weights"] + split["activations"] + int(0.125 * GiB),
             weight_dtype=str(engine.runner.dtype).removeprefix("torch."), kv_dtypes=(engine.runner.k_dtype,),
             sessions=config.kv_cache.max_concurrency_soft,
             batch_tokens=config.scheduler.max_num_batched_tokens)
    assert p.weights == split["weights"]
    assert p.activation_reserve == split["activations"]
    assert abs(p.rows[0].num_blocks - engine.pool.num_blocks) <= 1
    assert p.rows[0].bytes_per_token == engine.runner.bytes_per_token


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_plan_counts_quantized_weights_as_the_engine_holds_them(weights: str) -> None:
    from slimkv.plugins import build_engine
    from slimkv.kernels.qgemm import qgemm_kernel

    if qgemm_kernel() is None:
        pytest.skip("no weight kernel (no C compiler)")
    engine = build_engine(Config.from_dict({"kv_cache": {"memory_gb": 0.125},
                                            "model": {"weights": weights}}))
    held = engine.memory_split()["weights"]
    planned = plan("smollm2-135m", 4 * GiB, weight_dtype=weights, kv_dtypes=("int8",)).weights
    # equal up to the norm weights' dtype (bf16 in the plan, the engine's model dtype)
    assert abs(planned - held) <= 0.001 * held
    bf16 = plan("smollm2-135m", 4 * GiB, weight_dtype="bf16", kv_dtypes=("int8",)).weights
    bytes_per_weight = {"int4": 0.5, "int8": 1.0}[weights] + 4 / 32   # codes + d, m per 32
    assert planned < bf16 * bytes_per_weight / 2 * 1.05   # matrices dominate; rope/norms small
