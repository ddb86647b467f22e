"""A short ``slimkv bench capacity`` sweep (2 variants, 2 levels) writes the JSON, the
report and its plots, with the budget sized from the engine's own arithmetic."""

from __future__ import annotations

import json

import pytest
import torch

from slimkv.bench.capacity_report import analyze
from slimkv.cli import main
from slimkv.config import Config
from slimkv.engine.runner import resolve_dtype
from slimkv.kv.staging import Staging

pytestmark = pytest.mark.slow


def test_short_capacity_sweep_writes_the_report(tmp_path):
    out, report = tmp_path / "capacity" / "capacity.json", tmp_path / "REPORT.md"
    assert main(["bench", "capacity", "--variants", "bfloat16-contiguous,int8-paged",
                 "--concurrency", "1,3", "--duration", "2", "--sessions", "24", "--context", "160",
                 "--doc-tokens", "48", "--max-tokens", "6", "--out", str(out),
                 "--report", str(report), "--no-progress"]) == 0
    result = json.loads(out.read_text())
    assert [v["variant"] for v in result["variants"]] == ["bfloat16 contiguous", "int8 paged"]
    assert all([lv["concurrency"] for lv in v["levels"]] == [1, 3] for v in result["variants"])
    assert all(lv["error_count"] == 0 for v in result["variants"] for lv in v["levels"])

    kv = Config.load().kv_cache
    reserve = -(-160 // kv.block_size)
    contiguous, int8 = (v["levels"][0]["server"] for v in result["variants"])
    assert contiguous["kv_blocks_total"] * kv.watermark >= 24 * reserve
    assert contiguous["kv_pool_bytes"] == result["budget_bytes"]  # sized for bf16 exactly
    int8_block = int8["kv_pool_bytes"] // int8["kv_blocks_total"]
    # the default int8 keys use per-block scales: the staging blocks share the budget
    model_dtype = resolve_dtype(Config.load().model.dtype, torch.device("cpu"))  # staging's
    staging = Staging.bytes(30, 3, 64, kv.block_size, kv.max_concurrency_soft + 1, model_dtype)
    int8_total = int8["kv_pool_bytes"] + staging
    assert result["budget_bytes"] - int8_block < int8_total <= result["budget_bytes"]
    assert int8["kv_blocks_total"] > contiguous["kv_blocks_total"]

    rows = analyze(result)
    assert rows[0]["sessions"] >= 1 and rows[0]["sessions_x"] == 1.0
    text = report.read_text()
    assert "| bfloat16 contiguous |" in text and "| int8 paged |" in text
    for plot in ("capacity.png", "ttft.png"):
        assert (tmp_path / "capacity" / plot).stat().st_size > 0

    report.unlink()
    assert main(["bench", "capacity", "--from-json", str(out), "--report", str(report)]) == 0
    assert report.read_text() == text                # re-rendered from the JSON alone
