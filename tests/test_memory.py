"""Start-up memory measurement (slimkv/engine/memory.py): the activation peak the engine reports
and the planner reserves."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from slimkv.config import Config
from slimkv.engine.memory import LiveBytes, activation_peak
from slimkv.engine.sampling import SamplingParams
from slimkv.workload import random_prompt

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.slow


def test_start_up_survives_a_one_token_chunk() -> None:
    """The profile step splits the budget into max_model_len prompts: 512 % 511 == 1 (and
    max_model_len 1) leaves single-token queries, which once reached the fused C kernel
    with fake tensors (SIGSEGV). Run in a child so a crash is a failure, not the end of
    the test run."""
    code = ("from slimkv.config import Config\nfrom slimkv.plugins import build_engine\n"
            "for n in (511, 1):\n"
            "    config = Config.from_dict({'model': {'max_model_len': n, 'dtype': 'float32'},\n"
            "                               'kv_cache': {'num_blocks': 64}})\n"
            "    assert build_engine(config).memory_split()['activations'] > 0\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])


@pytest.mark.parametrize("k_scale", ["per_channel_block", "per_token"])
def test_start_up_figure_covers_a_real_step_of_that_shape(k_scale: str) -> None:
    """Independent check: the live bytes of a real engine step (one 512-token prompt, one
    sampled row; real tensors through the real runner) never exceed the replayed figure
    for that step. The default, staged layout was once replayed unstaged and came short."""
    from slimkv.plugins import build_engine

    config = Config.from_dict({"model": {"dtype": "float32"},
                               "kv_cache": {"num_blocks": 64, "k_scale": k_scale}})
    engine = build_engine(config)
    runner, budget = engine.runner, config.scheduler.max_num_batched_tokens
    engine.add_request(random_prompt(budget, engine.model_args.vocab_size, seed=0),
                       SamplingParams(max_tokens=1, temperature=0))
    with LiveBytes() as real:
        [out] = engine.step()
    assert out.finished and out.num_prompt_tokens == budget
    replayed = activation_peak(engine.model_args, runner.dtype, runner.device,
                               k_dtype=runner.k_dtype, v_dtype=runner.v_dtype, k_scale=k_scale,
                               block_size=config.kv_cache.block_size, num_tokens=budget,
                               num_logit_rows=1, max_len=runner.max_model_len)
    assert 0 < real.peak <= replayed
