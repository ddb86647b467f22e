"""The KV cache dashboard: ``/v1/cache/state`` under load, its key check, and ``/dashboard``
in a real headless Chromium (Debian ``chromium`` + ``chromium-driver``, driven by Selenium)."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import API_KEY, LiveServer, live_server, small_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# `make dashboard-png` sets it to docs/dashboard.png; a plain test run writes to a temp dir.
SCREENSHOT_ENV = "SLIMKV_DASHBOARD_PNG"
TOPICS = ["a lighthouse keeper", "the first train to the coast", "a city under snow",
          "two rival bakers", "a robot learning to paint", "the last day of summer"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--disable-dev-shm-usage", "--window-size=1440,900"]


def cache_state(server: LiveServer) -> dict[str, Any]:
    with server.http() as client:
        response = client.get("/v1/cache/state")
    assert response.status_code == 200, response.text
    return response.json()


def wait_for_state(server: LiveServer, done: Callable[[dict[str, Any]], bool],
                   timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while not done(state := cache_state(server)):
        assert time.monotonic() < deadline, f"state never came: {state['counts']}"
        time.sleep(0.1)
    return state


@contextmanager
def load(server: LiveServer, clients: int = 4, max_tokens: int = 48) -> Iterator[None]:
    """Keep ``clients`` story completions running until the block exits."""
    stop = threading.Event()

    def client(k: int) -> None:
        with server.http() as http:
            for n in range(10_000):
                if stop.is_set():
                    return
                topic = TOPICS[(k + n) % len(TOPICS)]
                http.post("/v1/completions", json={
                    "model": server.model, "max_tokens": max_tokens, "temperature": 0.8,
                    "prompt": f"Write a long, detailed story about {topic}. " * (1 + k % 4)})

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=60)


def assert_consistent(state: dict[str, Any]) -> None:
    """Block counts add up to the pool, and each block's fields agree with its state."""
    pool, counts, blocks = state["pool"], state["counts"], state["blocks"]
    assert sum(counts.values()) == pool["num_blocks"] == len(blocks)
    assert [b["id"] for b in blocks] == list(range(pool["num_blocks"]))
    for name, count in counts.items():
        assert sum(b["state"] == name for b in blocks) == count
    assert counts["in_use"] + counts["staging"] == pool["num_blocks"] - pool["num_free_blocks"]
    for block in blocks:
        assert (block["ref"] > 0) == (block["state"] in ("in_use", "staging"))
        assert block["last_used"] <= pool["clock"]


def test_cache_state_follows_requests_as_they_run_and_finish(server):
    assert_consistent(cache_state(server))
    with load(server):
        busy = wait_for_state(server, lambda s: s["counts"]["in_use"] > 0
                              and s["requests"]["running"] > 0)
        assert_consistent(busy)
        held = [b for b in busy["blocks"] if b["state"] in ("in_use", "staging")]
        assert all(b["requests"] and b["tokens"][1] - b["tokens"][0] == 16 for b in held)
        staging = wait_for_state(server, lambda s: s["counts"]["staging"] > 0)
        assert_consistent(staging)   # the default int8 keys use per-block scales: staged tails
    idle = wait_for_state(server, lambda s: s["requests"]["running"] == 0
                          and s["requests"]["waiting"] == 0)
    assert_consistent(idle)
    assert idle["counts"]["in_use"] == 0 and idle["counts"]["cached"] > 0  # finished: cached
    assert idle["step"] > busy["step"]
    assert idle["ttft"]["count"] > 0 and 0 < idle["ttft"]["p50_s"] <= idle["ttft"]["p99_s"]
    assert idle["prefix_cache"]["queries_total"] > 0
    assert len(idle["events"]["evictions"]) == idle["events"]["window_s"] == 60
    assert set(idle["memory"]) >= {"weights", "kv_cache", "activations", "kv_bytes_per_token"}


def test_cache_state_without_blocks_is_the_summary(server):
    with server.http() as client:
        state = client.get("/v1/cache/state", params={"blocks": "false"}).json()
    assert "blocks" not in state and sum(state["counts"].values()) == state["pool"]["num_blocks"]


def test_dashboard_and_state_need_the_api_key(server):
    url = server.url
    for path in ("/v1/cache/state", "/dashboard", "/dashboard/state"):
        assert httpx.get(url + path).status_code == 401
        assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401
    challenge = httpx.get(url + "/dashboard")
    assert challenge.headers["www-authenticate"].startswith("Basic ")
    assert httpx.get(url + "/dashboard", auth=("ops", "wrong")).status_code == 401
    page = httpx.get(url + "/dashboard", auth=("ops", API_KEY))
    assert page.status_code == 200 and 'id="map"' in page.text
    bearer = httpx.get(url + "/dashboard/state", headers={"Authorization": f"Bearer {API_KEY}"})
    assert bearer.status_code == 200 and bearer.json()["schema_version"] == 1
    assert httpx.get(url + "/dashboard/dashboard.js").status_code == 200  # code, no data


def chromium_driver(profile: str):
    """A headless Chromium, or a skip saying what is missing."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                    "(pip install -e '.[test]')")
    browser, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (browser and driver):
        pytest.skip("Debian chromium and chromium-driver are not installed "
                    "(scripts/test-deps.sh installs them where apt-get is allowed)")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    return webdriver.Chrome(options=options, service=webdriver.ChromeService(driver))


def wait_until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return value


@pytest.fixture(scope="module")
def small_pool_server() -> Iterator[LiveServer]:
    """A pool small enough for the load below to fill a good part of it (the screenshot)."""
    with live_server(small_config(kv_cache={"num_blocks": 96},
                                  server={"api_key": API_KEY})) as live:
        yield live


def screenshot_path(tmp_dir: Path) -> Path:
    """Where the browser test saves its screenshot: ``$SLIMKV_DASHBOARD_PNG`` when set
    (regenerating the doc image is an explicit command), else ``tmp_dir``."""
    return Path(os.environ.get(SCREENSHOT_ENV) or tmp_dir / "dashboard.png")


def test_a_test_run_leaves_the_doc_screenshot_alone(monkeypatch, tmp_path):
    monkeypatch.delenv(SCREENSHOT_ENV, raising=False)
    assert screenshot_path(tmp_path).parent == tmp_path
    monkeypatch.setenv(SCREENSHOT_ENV, str(ROOT / "docs" / "dashboard.png"))
    assert screenshot_path(tmp_path) == ROOT / "docs" / "dashboard.png"


def test_dashboard_in_a_real_browser_shows_the_pool_under_load(small_pool_server, tmp_path):
    server = small_pool_server
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By

    num_blocks = cache_state(server)["pool"]["num_blocks"]
    with tempfile.TemporaryDirectory() as profile:
        browser = chromium_driver(profile)
        try:
            host = server.url.removeprefix("http://")
            with load(server, clients=6, max_tokens=64):
                browser.get(f"http://ops:{API_KEY}@{host}/dashboard")  # Basic auth, key as password
                cells = wait_until(lambda: browser.find_elements(By.CSS_SELECTOR, "#map .cell"),
                                   20, "the block map")
                assert len(cells) == num_blocks

                def count(state: str) -> int:
                    return len(browser.find_elements(By.CSS_SELECTOR, f"#map .cell.s-{state}"))

                wait_until(lambda: count("in_use") >= 12 and count("cached"), 60,
                           "a dozen in-use cells, and cached ones from finished requests")

                def hover_in_use() -> str:
                    """The tooltip of an in-use cell (cells change state as requests end)."""
                    cells = browser.find_elements(By.CSS_SELECTOR, "#map .cell.s-in_use")
                    if cells:
                        ActionChains(browser).move_to_element(cells[0]).perform()
                    text = browser.find_element(By.ID, "tip").text
                    return text if "in use" in text else ""

                assert "cmpl-" in wait_until(hover_in_use, 20, "an in-use cell's tooltip")
                assert "live" in browser.find_element(By.ID, "status").text
                screenshot = screenshot_path(tmp_path)
                screenshot.parent.mkdir(parents=True, exist_ok=True)
                assert browser.save_screenshot(str(screenshot))
        finally:
            browser.quit()


def test_a_sessions_head_is_pinned_between_turns_and_reused(server):
    document = "The lighthouse on Carrow Point was built in 1861 of grey granite. " * 12
    turn1 = [{"role": "user", "content": document + "\nSummarise this in one line."}]
    with server.http() as http:
        first = http.post("/v1/chat/completions", headers={"X-Session-ID": "doc-42"}, json={
            "model": server.model, "messages": turn1, "max_tokens": 16, "temperature": 0})
        assert first.status_code == 200, first.text
        state = cache_state(server)
        pinned = [b for b in state["blocks"] if b["state"] == "pinned"]
        assert pinned and all(b["session"] == "doc-42" for b in pinned)
        assert state["counts"]["pinned"] == len(pinned)
        turn2 = turn1 + [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": "When was it built?"}]
        second = http.post("/v1/chat/completions", json={
            "model": server.model, "messages": turn2, "max_tokens": 8, "temperature": 0,
            "session_id": "doc-42"})
    assert second.status_code == 200, second.text
    cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= len(pinned) * 16
