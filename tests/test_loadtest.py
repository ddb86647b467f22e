"""``slimkv loadtest`` against live slimkv servers: counts that agree with the server's own
metrics, every percentile present, and errors counted (not raised) when the server dies."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from conftest import live_server, small_config
from slimkv.cli import main
from slimkv.loadtest.report import percentile, summarize
from slimkv.loadtest.runner import LevelRun, RunSpec, run_level
from slimkv.loadtest.workloads import ClientWorkload, WorkloadSpec, corpus

SMALL = WorkloadSpec("mixed", context=256, doc_tokens=64, max_tokens=8, chat_max_tokens=8)


def test_percentile_interpolates_and_handles_empty():
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile([0.0, 10.0], 99) == pytest.approx(9.9)


def test_workload_is_seeded_and_sessions_stay_in_context():
    text = corpus()
    turns = [[ClientWorkload(SMALL, 4, client, text).next_turn().messages for client in (0, 1)]
             for _ in range(2)]
    assert turns[0] == turns[1]                      # same seed, same content
    other = ClientWorkload(SMALL, 8, 0, text).next_turn().messages
    assert other != turns[0][0]                      # levels never share a prefix
    session = ClientWorkload(WorkloadSpec(context=256, doc_tokens=64, max_tokens=8), 1, 0, text)
    names = []
    for _ in range(12):
        turn = session.next_turn()
        names.append(turn.session)
        session.record("an answer", None)
    assert len(set(names)) > 1                       # sessions end at the context and restart
    assert max(names.count(n) for n in names) > 1    # and hold several turns each


@pytest.mark.slow
def test_loadtest_counts_match_the_server(server):
    before = server.metric("slimkv:request_success_total", finished_reason="length")
    spec = RunSpec(server.url, server.model, SMALL, duration=8.0, api_key=server.api_key,
                   extra_body={"ignore_eos": True})
    run = asyncio.run(run_level(spec, 2))
    summary = summarize(run)
    completed = [r for r in run.results if r.ok]
    assert summary["error_count"] == 0 and summary["errors"] == {}
    assert summary["requests_completed"] == len(completed) > 0
    assert summary["requests_sent"] == len(completed) + summary["requests_cancelled_at_end"]
    assert all(r.completion_tokens == SMALL.max_tokens for r in completed)
    assert all(r.prompt_tokens and r.ttft is not None for r in completed)
    server.wait_for_metric("slimkv:num_requests_running", 0)
    finished = server.metric("slimkv:request_success_total", finished_reason="length") - before
    # A request the client cancels at the end of the run may already have produced its last
    # token on the server, which then counts it as finished: the only race between the two.
    cancelled = summary["requests_cancelled_at_end"]
    assert len(completed) <= finished <= len(completed) + cancelled
    for key, qs in (("ttft_s", (50, 90, 99)), ("itl_s", (50, 99)), ("e2e_s", (50, 90, 99))):
        assert all(summary[key][f"p{q}"] is not None for q in qs), key
    assert summary["output_tokens_per_s"] > 0
    assert summary["total_tokens_per_s"] > summary["output_tokens_per_s"]


@pytest.mark.slow
def test_errors_are_counted_when_the_server_stops_mid_run():
    runs: list[LevelRun] = []
    with live_server(small_config()) as live:
        spec = RunSpec(live.url, live.model, SMALL, duration=10.0, request_timeout=20.0,
                       extra_body={"ignore_eos": True})
        worker = threading.Thread(target=lambda: runs.append(asyncio.run(run_level(spec, 3))))
        worker.start()
        time.sleep(3.0)
    worker.join(timeout=60)
    assert not worker.is_alive() and len(runs) == 1
    summary = summarize(runs[0])
    assert summary["error_count"] > 0
    assert set(summary["errors"]) <= {"connect", "disconnect", "incomplete", "http_503",
                                      "stream_error", "timeout"}
    assert sum(summary["errors"].values()) == summary["error_count"]


@pytest.mark.slow
def test_cli_prints_the_table_and_writes_json_and_plot(server, tmp_path, capsys):
    out, plot = tmp_path / "lt.json", tmp_path / "lt.png"
    assert main(["loadtest", "--url", server.url, "--model", server.model, "--api-key",
                 server.api_key, "--concurrency", "1", "--workload", "chat", "--duration", "4",
                 "--chat-max-tokens", "4", "--json", str(out), "--plot", str(plot),
                 "--no-progress"]) == 0
    assert "ttft99" in capsys.readouterr().out
    assert out.stat().st_size > 0 and plot.stat().st_size > 0
