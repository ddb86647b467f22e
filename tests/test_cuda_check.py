"""``bash scripts/cuda_check.sh --dry-run``: every step of the GPU check, run on this CPU in
a venv holding only what the GPU image has (Triton 3.6.0, no fastapi / uvicorn / pydantic /
gguf / llguidance / ray) plus the carried wheels, at tiny shapes: each JSON it writes on a
lent GPU is written here too, and is sane. The venv is cached under ~/.cache/slimkv-dryrun
(its first build takes a minute or two from the local wheels; a run after that ~2.5 min).
It also runs the interpreted kernel tests under Triton 3.6.0, CI's guard for that Triton."""

from __future__ import annotations

import json
import os
import shutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ["bfloat16", "int8", "fp8_e4m3"]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("python3.11") is None, reason="the dry run's venv needs python3.11")
def test_dry_run_writes_every_file(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SLIMKV_DRY_RUN")}
    result = subprocess.run(["bash", "scripts/cuda_check.sh", "--dry-run"], cwd=ROOT,
                            env={**env, "OUT": str(tmp_path)}, capture_output=True, text=True,
                            timeout=900)
    log = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 0, log
    steps = json.loads((tmp_path / "steps.json").read_text())
    assert [s["step"] for s in steps] == ["wheels", "versions", "checkpoint", "greedy",
                                          "bench_engine", "cuda_tests", "prefill_tests",
                                          "interpreter_tests"], log
    assert all(s["rc"] == 0 for s in steps), steps
    gpu_steps = [s["seconds"] for s in steps if s["step"] != "interpreter_tests"]
    assert sum(gpu_steps) < 340, steps  # the GPU run's deadline

    versions = json.loads((tmp_path / "versions.json").read_text())
    assert versions["triton"] == "3.6.0" and versions["dry_run"] and versions["gpu"] is None
    # The CUDA tests collect on the image (no import error) and skip here, all of them.
    tests = (tmp_path / "tests.log").read_text()
    assert "7 skipped" in tests and "error" not in tests.lower(), tests
    # The 16-bit prefill tests: float16 passes under the interpreter, bf16 is GPU-only.
    prefill = (tmp_path / "prefill.log").read_text()
    assert "4 passed, 4 skipped" in prefill, prefill

    # Every kernel test under Triton 3.6.0's interpreter (bf16 prefill: GPU only): as many
    # passed as this checkout's pytest collects there, less those four.
    interpreted = (tmp_path / "interpreter.log").read_text()
    files = ["tests/test_triton_kernels.py", "tests/test_triton_prefill.py"]
    collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", *files],
                               cwd=ROOT, capture_output=True, text=True).stdout
    total = int(re.search(r"(\d+) tests? collected", collected).group(1))
    assert f"{total - 4} passed, 4 skipped" in interpreted, interpreted[-2000:]

    greedy = json.loads((tmp_path / "greedy.json").read_text())
    assert greedy["prompts"] == greedy["equal"] == 4, greedy
    assert all(len(t) == 32 for side in greedy["tokens"].values() for t in side), greedy

    engine = json.loads((tmp_path / "engine.json").read_text())
    assert list(engine["results"]) == DTYPES, engine
    assert engine["config"]["max_num_batched_tokens"] * 2 < 4 * engine["config"]["context"]
    for dtype, row in engine["results"].items():
        assert "error" not in row, (dtype, row)
        assert row["decode_b4_ctx40_steps"] == 4 and row["decode_b4_ctx40_tok_s"] > 0, row
        assert row["prefill_32_tok_s"] > 0 and row["bytes_per_token"] > 0, row
