"""/metrics, the deploy/ kit, and a real Prometheus scraping a live server."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml

from conftest import free_port

pytestmark = pytest.mark.slow

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
METRIC = re.compile(r"slimkv:[A-Za-z0-9_:]+")
NAMES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
         "kv_cache_blocks_total", "kv_cache_blocks_used", "prefix_cache_queries_total",
         "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
         "generation_tokens_total", "request_success_total", "kv_cache_watermark_alert",
         "kv_cache_evictions_total", "attention_path_total", "memory_bytes",
         "kv_cache_dtype_info", "time_to_first_token_seconds_count",
         "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
         "request_queue_time_seconds_count"]


def complete(server, prompt: str, max_tokens: int = 3) -> dict:
    with server.http() as http:
        r = http.post("/v1/completions", json={"model": server.model, "prompt": prompt,
                                               "max_tokens": max_tokens, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_every_metric_is_exported_with_the_model_label(server):
    complete(server, "Hello")
    text = httpx.get(f"{server.url}/metrics").text
    for name in NAMES:
        assert re.search(rf'^slimkv:{name}{{[^}}]*model_name="{server.model}"', text, re.M), name


def test_a_request_moves_the_counters(server):
    names = ["slimkv:prompt_tokens_total", "slimkv:generation_tokens_total",
             "slimkv:time_to_first_token_seconds_count", "slimkv:e2e_request_latency_seconds_count"]
    before = {n: server.metric(n) for n in names}
    length_before = server.metric("slimkv:request_success_total", finished_reason="length")
    usage = complete(server, "The weather today is", max_tokens=4)
    after = {n: server.metric(n) for n in names}
    assert after["slimkv:prompt_tokens_total"] - before["slimkv:prompt_tokens_total"] == usage["prompt_tokens"]
    assert after["slimkv:generation_tokens_total"] - before["slimkv:generation_tokens_total"] == 4
    assert after["slimkv:time_to_first_token_seconds_count"] == before["slimkv:time_to_first_token_seconds_count"] + 1
    assert after["slimkv:e2e_request_latency_seconds_count"] == before["slimkv:e2e_request_latency_seconds_count"] + 1
    assert server.metric("slimkv:request_success_total", finished_reason="length") == length_before + 1
    assert server.metric("slimkv:attention_path_total") > 0


def test_pool_memory_and_kv_format(server):
    assert server.metric("slimkv:kv_cache_blocks_total") == 256
    assert 0 <= server.metric("slimkv:kv_cache_usage_perc") <= 1
    assert server.metric("slimkv:memory_bytes", component="weights") > 100e6  # 135M params
    assert server.metric("slimkv:memory_bytes", component="kv_cache") > 0
    assert server.metric("slimkv:kv_cache_dtype_info", k_dtype="int8", v_dtype="int8") == 1
    assert server.metric("slimkv:kv_cache_watermark_alert") == 0


def test_a_repeated_prompt_hits_the_prefix_cache(server):
    prompt = "Summarize: " + "the quick brown fox jumps over the lazy dog. " * 8
    complete(server, prompt, max_tokens=1)
    hits = server.metric("slimkv:prefix_cache_hits_total")
    complete(server, prompt, max_tokens=1)
    assert server.metric("slimkv:prefix_cache_hits_total") >= hits + 32


def test_alert_rules_pass_promtool():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus; see scripts/test-deps.sh)")
    result = subprocess.run([promtool, "check", "rules", str(DEPLOY / "alerts.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS: 3 rules found" in result.stdout


def dashboard_exprs() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def test_every_dashboard_metric_exists(server):
    complete(server, "Hi")
    exported = {line.split("{")[0].split(" ")[0]
                for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                if line.startswith("slimkv:")}
    queried = {m for expr in dashboard_exprs() for m in METRIC.findall(expr)}
    assert len(queried) >= 15
    assert queried <= exported, queried - exported


@pytest.fixture(scope="module")
def prometheus(server, tmp_path_factory):
    """A real Prometheus scraping ``server`` every second with deploy/prometheus.yml."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus not installed (Debian package prometheus, installed by "
                    "scripts/test-deps.sh where apt-get is available)")
    tmp = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s")
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [server.url.split("//")[1]]
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config))
    shutil.copy(DEPLOY / "alerts.yml", tmp / "alerts.yml")
    port = free_port()
    proc = subprocess.Popen([binary, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=(tmp / "log").open("w"))
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(timeout=30)


def query(prometheus: str, expr: str, timeout: float = 30.0) -> list[dict]:
    """Poll an instant query until it returns a series (scrapes take a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            body = httpx.get(f"{prometheus}/api/v1/query", params={"query": expr}).json()
            if body["status"] == "success" and body["data"]["result"]:
                return body["data"]["result"]
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            return []
        time.sleep(0.5)


def test_prometheus_scrapes_the_server(server, prometheus):
    complete(server, "What is two plus two?")
    [usage] = query(prometheus, "slimkv:kv_cache_usage_perc")
    assert usage["metric"]["model_name"] == server.model
    assert 0 <= float(usage["value"][1]) <= 1
    [ttft] = query(prometheus, "slimkv:time_to_first_token_seconds_count > 0")
    assert float(ttft["value"][1]) > 0
    rules = httpx.get(f"{prometheus}/api/v1/rules").json()["data"]["groups"]
    assert {r["name"] for g in rules for r in g["rules"]} == {
        "SlimkvKVCacheOverWatermark", "SlimkvRequestsWaitingGrowing", "SlimkvP99TTFTHigh"}
    for expr in dashboard_exprs():
        r = httpx.get(f"{prometheus}/api/v1/query",
                      params={"query": expr.replace("$__rate_interval", "1m")
                              .replace('model_name=~"$model"', 'model_name=~".*"')})
        assert r.json()["status"] == "success", (expr, r.text)
