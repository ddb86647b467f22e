"""``slimkv bench kernels`` and ``slimkv bench ab`` through the CLI, at tiny sizes on the real
kernels: the JSON's shape and sanity (times positive, the CPU and auto's dtype recorded, a
build compared with itself agreeing bit for bit). Every file goes to a temp dir."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from slimkv.cli import main
from slimkv.backends.cpu_decode import SOURCE
from slimkv.kernels.prefill_attn import prefill_kernel_unavailable_reason

KERNELS = SOURCE.parent
TINY_DECODE = ["--batch", "2", "--context", "40", "--layers", "2", "--reps", "2"]


def run(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "out.json"
    assert main(["bench", *argv, "--out", str(out)]) == 0
    return json.loads(out.read_text())


def timed(row: dict, reps: int = 2) -> None:
    assert 0 < row["best_ms"] <= row["median_ms"]
    assert len(row["runs_ms"]) == reps and min(row["runs_ms"]) == row["best_ms"]


def test_kernels_every_part(tmp_path: Path, fused_kernel: None) -> None:
    result = run(tmp_path, "kernels", "--layers", "2", "--batches", "2", "--context", "40",
                 "--kv-dtypes", "bfloat16,int8,int4/int8", "--rows", "1,24",
                 "--kernel-rows", "8", "--vocab", "256", "--prefill-tokens", "48",
                 "--mem-mib", "8", "--reps", "2")
    machine = result["machine"]
    assert machine["cpu"] and isinstance(machine["isa"], list)
    assert machine["model_dtype_auto"] in ("bfloat16", "float32")
    assert machine["dtype"] == machine["model_dtype_auto"]  # never forced by default
    assert result["setup"]["layers"] == 2 and result["setup"]["parts"] == [
        "decode", "gemm", "prefill", "rows", "memory"]
    decode = result["decode"]
    assert set(decode) == {"b2/bfloat16", "b2/int8", "b2/int4/int8"}
    for row in decode.values():
        timed(row)
        assert row["kv_bytes"] > 0 and row["kv_gb_s"] > 0
    assert decode["b2/int4/int8"]["kv_bytes"] < decode["b2/int8"]["kv_bytes"] \
        < decode["b2/bfloat16"]["kv_bytes"]
    gemm = result["gemm"]
    timed(gemm["dequantize_all"])
    assert set(gemm["rows1"]) == {"int8_kernel", "precise_kernel", "dequant_gemm",
                                  "resident_gemm"}
    assert set(gemm["rows24"]) == {"dequant_gemm", "resident_gemm"}  # over --kernel-rows
    for row in (*gemm["rows1"].values(), *gemm["rows24"].values()):
        timed(row)
    for case in ("causal", "staged", "staged_one_call"):
        timed(result["prefill"][case]["sdpa"])
        if "kernel" in result["prefill"][case]:
            timed(result["prefill"][case]["kernel"])
            assert result["prefill"][case]["max_abs_diff"] < 0.05  # bf16 rounding apart
    rows = result["rows"]   # row counts 9..48: exact 40 x 4 shapes, buckets 8 + 2 (32, 48)
    assert rows["rows"] == [9, 48]
    assert rows["exact"]["shapes"] == 160 and rows["bucketed"]["shapes"] == 4 * (8 + 2)
    for name in ("exact", "bucketed"):
        assert rows[name]["first_sweep_ms"] > 0 and rows[name]["rss_growth_mib"] > -64
        timed(rows[name]["warm_sweep"])
        timed(rows[name]["warm_sweep_every_8th"])
    assert result["memory"]["sum_gb_s"] > 0 and result["memory"]["max_gb_s"] > 0


def test_kernels_dtype_named(tmp_path: Path) -> None:
    result = run(tmp_path, "kernels", "--parts", "prefill", "--prefill-tokens", "32",
                 "--reps", "1", "--dtype", "float32")
    assert result["machine"]["dtype"] == "float32"
    assert "kernel_skipped" in result["prefill"]  # the prefill kernel is bf16 only
    assert set(result) == {"machine", "setup", "prefill"}
    timed(result["prefill"]["causal"]["sdpa"], reps=1)


def test_ab_decode_build_against_a_copy_of_itself(tmp_path: Path, fused_kernel: None) -> None:
    copy = tmp_path / "kernels"
    copy.mkdir()
    for source in (*KERNELS.glob("*.c"), *KERNELS.glob("*.h")):
        shutil.copy(source, copy)
    result = run(tmp_path, "ab", "--builds", str(copy), str(KERNELS),
                 "--kv-dtypes", "int8,int4", *TINY_DECODE)
    assert result["mode"] == "builds" and result["kernel"] == "decode"
    assert result["variants"] == {"A": str(copy), "B": str(KERNELS)}
    assert result["machine"]["cpu"]
    assert set(result["results"]) == {"int8", "int4"}
    for row in result["results"].values():
        timed(row["A"]), timed(row["B"])
        assert row["max_abs_diff"] == 0.0
        assert row["b_over_a"]["best"] > 0


@pytest.mark.skipif(prefill_kernel_unavailable_reason() is not None,
                    reason=str(prefill_kernel_unavailable_reason()))
def test_ab_prefill_build_against_sdpa(tmp_path: Path) -> None:
    result = run(tmp_path, "ab", "--builds", str(KERNELS), "sdpa", "--kernel", "prefill",
                 "--prefill-tokens", "48", "--reps", "2")
    assert set(result["results"]) == {"causal", "staged", "staged_one_call"}
    for row in result["results"].values():
        timed(row["A"]), timed(row["B"])
        assert 0 < row["max_abs_diff"] < 0.05  # kernel vs SDPA: bf16 rounding only


def test_ab_bad_override_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "ab", "--set-b", "kv_cache.dtype", "--out",
                 str(tmp_path / "x.json")]) == 2
    assert "SECTION.KEY=VALUE" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow
def test_ab_engine_configs(tmp_path: Path, fused_kernel: None) -> None:
    result = run(tmp_path, "ab", "--set-b", "kv_cache.dtype=int4", "--batch", "2",
                 "--context", "24", "--steps", "2", "--reps", "2")
    assert result["mode"] == "configs"
    assert result["variants"] == {"A": "default", "B": "default kv_cache.dtype=int4"}
    assert result["engines"]["A"]["kv_dtype"] == "int8/int8"
    assert result["engines"]["B"]["kv_dtype"] == "int4/int4"
    row = result["results"]["decode_step"]
    timed(row["A"]), timed(row["B"])
    assert "max_abs_diff" not in row


@pytest.mark.slow
def test_ab_engine_build_against_itself(tmp_path: Path, fused_kernel: None) -> None:
    result = run(tmp_path, "ab", "--builds", str(KERNELS), str(KERNELS), "--kernel", "engine",
                 "--kv-dtypes", "int8", "--batch", "2", "--context", "24", "--steps", "2",
                 "--reps", "2")
    row = result["results"]["int8"]
    timed(row["A"]), timed(row["B"])
    assert row["attention_paths"]
