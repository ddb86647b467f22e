"""Merging single-variant capacity runs and checking the issue's targets."""

import json

import pytest

from slimkv.bench.capacity_report import analyze
from slimkv.bench.capacity_targets import merge, targets_section


def part(tmp_path, name, running, blocks, budget=100):
    level = {"concurrency": 64, "error_count": 0, "requests_sent": 50,
             "requests_unserved_at_end": 0, "ttft_s": {"p99": 1.0},
             "server": {"peak_running": running, "preemptions": 0, "peak_waiting": 3,
                        "peak_kv_blocks_used": blocks * 0.7, "kv_blocks_total": blocks,
                        "peak_kv_bytes_used": 10}}
    result = {"budget_bytes": budget, "elapsed_s": 1.0, "command": f"run {name}",
              "spec": {"levels": [64], "variants": [name]},
              "config": {"max_concurrency_soft": 64, "watermark": 0.7},
              "variants": [{"variant": name, "levels": [level]}]}
    path = tmp_path / f"{name.replace(' ', '-')}.json"
    path.write_text(json.dumps(result))
    return str(path)


def test_merge_keeps_order_labels_and_checks_targets(tmp_path):
    parts = [part(tmp_path, "bfloat16 contiguous", 12, 100),
             part(tmp_path, "bfloat16 paged", 20, 100),
             part(tmp_path, "int8 paged", 38, 190) + "=int8 paged (per-token K)",
             part(tmp_path, "int4 paged", 50, 290)]
    merged = merge(parts)
    assert [v["variant"] for v in merged["variants"]] == [
        "bfloat16 contiguous", "bfloat16 paged", "int8 paged (per-token K)", "int4 paged"]
    assert [p["command"] for p in merged["parts"]][0] == "run bfloat16 contiguous"
    text = "\n".join(targets_section(merged, analyze(merged)))
    assert "| int8 paged (per-token K) / bfloat16 paged | x1.90 (38 / 20) | >= x1.9 | yes | x1.90 |" in text
    assert "| int4 paged / bfloat16 paged | x2.50 (50 / 20) | >= x3.5 | NO | x2.90 |" in text


def test_merge_refuses_two_budgets(tmp_path):
    with pytest.raises(ValueError, match="budget"):
        merge([part(tmp_path, "bfloat16 paged", 20, 100),
               part(tmp_path, "int8 paged", 38, 190, budget=200)])
