"""Sizing the pool from device memory (``kv_cache.memory_gb: null`` on CUDA, with
``kv_cache.memory_fraction``, as vLLM's ``gpu_memory_utilization``)."""

from __future__ import annotations

import pytest
import torch

from slimkv.config import Config, ConfigError
from slimkv.engine.memory import device_kv_budget, kv_budget

GiB = 1 << 30


def test_the_budget_is_the_fraction_less_what_is_used_and_the_activation_peak() -> None:
    # An 80 GiB card, 14 GiB already used (weights + context), 1 GiB of activations, 0.9:
    # 72 GiB allowed, 72 - 14 - 1 = 57 GiB for the pool.
    assert kv_budget(66 * GiB, 80 * GiB, 0.9, GiB) == 57 * GiB
    # Another process holding memory shrinks the pool by as much.
    assert kv_budget(46 * GiB, 80 * GiB, 0.9, GiB) == 37 * GiB
    # A fraction below what is already used leaves nothing (the runner then refuses).
    assert kv_budget(66 * GiB, 80 * GiB, 0.1, GiB) < 0


def test_sizing_from_device_memory_needs_cuda() -> None:
    with pytest.raises(ConfigError, match="kv_cache.memory_gb.*CUDA device.*num_blocks"):
        device_kv_budget(torch.device("cpu"), 0.9, 0)


def test_memory_gb_may_be_unset_and_the_fraction_is_checked() -> None:
    config = Config.from_dict({"kv_cache": {"memory_gb": None}})
    assert config.kv_cache.memory_gb is None and config.kv_cache.memory_fraction == 0.9
    for bad in (0, 1.5, "0.9"):
        with pytest.raises(ConfigError, match="kv_cache.memory_fraction"):
            Config.from_dict({"kv_cache": {"memory_fraction": bad}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_budget_reads_the_device() -> None:
    device = torch.device("cuda")
    free, total = torch.cuda.mem_get_info(device)
    assert device_kv_budget(device, 0.9, 0) == kv_budget(free, total, 0.9, 0)
