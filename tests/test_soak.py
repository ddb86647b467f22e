"""``slimkv bench soak``'s bookkeeping, without servers: the memory-growth measure, the
overload verdicts, and a phase that breaks (recorded with its traceback, its verdicts
missed, the result saved after every phase, the next phase still run, the plot drawn).
The phases themselves run on real servers in tests/test_drain_crash.py and
tests/test_shared_tier.py, and in full in the committed run (bench/soak/)."""

from __future__ import annotations

import pytest

from slimkv.bench import soak
from slimkv.bench.soak_crash import CrashSpec
from slimkv.bench.soak_kills import KillSpec
from slimkv.bench.soak_overload import OverloadSpec, rss_growth
from slimkv.bench.soak_plot import plot_soak
from slimkv.config import Config

MiB = 2**20


def test_rss_growth_is_median_of_three_at_the_start_to_median_of_three_at_the_end() -> None:
    samples = [(0.0, 500 * MiB), (60.0, 900 * MiB)]                   # before from_s: ignored
    samples += [(120.0, 1000 * MiB), (130.0, 2000 * MiB), (140.0, 1010 * MiB)]  # median 1010
    samples += [(150.0, 1050 * MiB), (160.0, 1060 * MiB), (170.0, 0), (180.0, 1040 * MiB)]
    g = rss_growth(samples, from_s=120.0)
    assert g["samples"] == 6 and g["base_mb"] == 1010.0 and g["end_mb"] == 1050.0
    assert g["max_mb"] == 2000.0 and g["growth"] == round(1050 / 1010 - 1, 4)
    assert rss_growth(samples[:3], from_s=120.0)["growth"] is None


def overload_result(growth: float | None, **changes) -> dict:
    return {"requests": 10, "outcomes": {"ok": 4, "busy": 6}, "server_alive": True,
            "server_errors_5xx": 0, "hangs": 0, "busy_without_retry_after": 0,
            "after": {"num_requests_running": 0, "num_requests_waiting": 0,
                      "kv_cache_blocks_used": 0}, "rss": {"growth": growth}, **changes}


def test_overload_verdicts() -> None:
    assert all(soak.overload_verdicts(overload_result(0.049)).values())
    assert not soak.overload_verdicts(overload_result(0.05))["rss_flat"]
    assert not soak.overload_verdicts(overload_result(None))["rss_flat"]
    assert not soak.overload_verdicts(overload_result(0.0, outcomes={"ok": 9, "error": 1}))[
        "overload_only_429"]
    assert not soak.overload_verdicts(overload_result(0.0, busy_without_retry_after=1))[
        "overload_only_429"]
    after = {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_blocks_used": 3}
    assert not soak.overload_verdicts(overload_result(0.0, after=after))["no_leaked_blocks"]


def test_a_phase_that_breaks_is_recorded_and_the_next_still_runs(monkeypatch, tmp_path) -> None:
    ran: list[str] = []

    def broken(*args) -> dict:
        ran.append("kills")
        raise RuntimeError("the cluster did not start")

    def crash(*args) -> dict:
        ran.append("crash")
        return {"damaged_on_purpose": [], "corrupt_blocks_after_replay": 0,
                "corrupt_blocks_at_start": 0, "audit_after_kill": {"bad": 0, "chunks": 3, "tmp": 0},
                "tmp_files_after_restart": 0, "turns_equal": 2, "turns_compared": 2,
                "killed_mid_write": True, "turns_before_kill": 8}

    monkeypatch.setattr(soak, "run_kills", broken)
    monkeypatch.setattr(soak, "run_crash", crash)
    saved: list[dict] = []
    result = soak.run_soak(Config.load(None), ("kills", "crash"), OverloadSpec(), KillSpec(),
                           CrashSpec(), str(tmp_path),
                           save=lambda r: saved.append({"phases": [p for p in r if p in ran]}))
    assert ran == ["kills", "crash"] and len(saved) == 2
    assert "the cluster did not start" in result["kills"]["error"]
    assert result["verdicts"] == {"replica_kill_all_answered": False,
                                  "reroute_reloads_kv": False,
                                  "crash_no_bad_chunk_loaded": True, "crash_outputs_equal": True}
    png = tmp_path / "soak.png"
    plot_soak(result, png)
    assert png.stat().st_size > 10_000


@pytest.mark.parametrize("phases", ["", "overload,typo"])
def test_the_command_names_a_bad_phase(phases, capsys) -> None:
    from slimkv.cli import main

    assert main(["bench", "soak", "--phases", phases, "--out", "/nonexistent/x.json"]) == 2
    assert "--phases: choose from overload, kills, crash" in capsys.readouterr().err
