"""The dashboard in a real headless Chromium (Debian's chromium and chromium-driver, through selenium)
against a real CPU server: requests sharing a prefix, one request with n=4, and a prefix left cached by an
earlier request. The page's map must show blocks in use, shared and cached (read from the canvas's pixels),
its table must list the requests, and a click must highlight one request's blocks. The server records a
--kv-trace at the same time, which the page then replays. Screenshots go to the test's tmp dir (and to
$PAGEDSERVE_DASHBOARD_SCREENSHOTS, a folder, when set: that is how docs/images/ got theirs).

scripts/test installs chromium and chromium-driver where it can (scripts/_browser.sh); without them this
test skips and says so.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.processes import start_server

pytestmark = pytest.mark.e2e

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
PREFIX = "The pool of KV blocks is shared by every request that starts with these same words. " * 3


def _driver() -> Any:
    if CHROMIUM is None or CHROMEDRIVER is None:
        pytest.skip("no chromium/chromedriver: scripts/test installs Debian's chromium and chromium-driver")
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is in requirements-dev.txt")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1600")
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)


def _complete(url: str, prompt: str, max_tokens: int, n: int = 1) -> dict[str, Any]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "n": n, "ignore_eos": True, "temperature": 0.8}
    request = urllib.request.Request(
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as reply:
        return json.loads(reply.read())


def _wait(driver: Any, script: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for: {script}")


# The map's pixels by kind: the page's fixed colours for cached and shared blocks, and any saturated colour
# (the per-request hues) for blocks in use.
PIXEL_COUNTS = """
const canvas = document.getElementById('map');
const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
const near = (i, r, g, b) =>
  Math.abs(data[i] - r) + Math.abs(data[i + 1] - g) + Math.abs(data[i + 2] - b) < 12;
let cached = 0, shared = 0, used = 0;
for (let i = 0; i < data.length; i += 4) {
  if (data[i + 3] < 250) continue;
  if (near(i, 0x9f, 0xd8, 0xac)) cached++;
  else if (near(i, 0x1f, 0x22, 0x30)) shared++;
  else if (Math.max(data[i], data[i + 1], data[i + 2]) - Math.min(data[i], data[i + 1], data[i + 2]) > 60)
    used++;
}
return {cached, shared, used};
"""


def _save(driver: Any, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    driver.save_screenshot(str(path))
    docs = os.environ.get("PAGEDSERVE_DASHBOARD_SCREENSHOTS")
    if docs:
        shutil.copy(path, Path(docs) / name)
    return path


def test_dashboard_shows_used_shared_and_cached_blocks_and_the_requests(tiny_model_dir, tmp_path):
    driver = _driver()
    trace = tmp_path / "kv-trace.jsonl"
    server = start_server(
        tiny_model_dir, tmp_path / "logs", num_kv_blocks=160, max_num_seqs=16, max_num_batched_tokens=512,
        max_model_len=512, kv_trace=str(trace), kv_snapshot_interval_s=0.1,
    )  # fmt: skip
    try:
        # A first request leaves its blocks in the prefix cache (free, reusable) when it ends.
        _complete(server.url, PREFIX + "A first question about caching, with its own long tail of words.", 24)
        driver.get(server.url + "/dashboard")
        _wait(driver, "return window.dashboard && window.dashboard.last !== null")
        assert int(driver.execute_script("return window.dashboard.cellCounts.cached")) > 0
        results: list[Any] = []
        jobs = [(PREFIX + f"Question {i}?", 160, 1) for i in range(3)] + [("Four samples, please:", 160, 4)]
        threads = [
            threading.Thread(target=lambda job=job: results.append(_complete(server.url, *job)))
            for job in jobs
        ]
        for thread in threads:
            thread.start()
        counts = _wait(
            driver,
            "const c = window.dashboard.cellCounts; const rows = window.dashboard.last.requests;"
            "return c.used > 0 && c.shared > 0 && c.cached > 0 && rows.length === 4 && c;",
        )
        pixels = driver.execute_script(PIXEL_COUNTS)
        assert pixels["cached"] > 0 and pixels["shared"] > 0 and pixels["used"] > 0, (counts, pixels)
        table = driver.execute_script(  # in one call: the table is redrawn with every snapshot
            "return [...document.querySelectorAll('#requests tbody tr')]"
            ".map(tr => [...tr.cells].map(td => td.textContent))"
        )
        assert len(table) == 4, table
        assert sorted(row[3] for row in table) == ["1", "1", "1", "4"]  # seqs: the n=4 request's four
        assert sum(1 for row in table if int(row[8]) > 0) >= 2  # prefix-cache hit tokens
        assert all(row[2] == "running" for row in table)
        _save(driver, tmp_path, "dashboard.png")
        # Clicking the n=4 request highlights its blocks: the others are drawn faded.
        clicked = driver.execute_script(
            "const tr = [...document.querySelectorAll('#requests tbody tr')]"
            ".find(tr => tr.cells[3].textContent === '4'); tr.click(); return tr.dataset.requestId;"
        )
        assert driver.execute_script("return window.dashboard.selected") == clicked
        assert driver.execute_script("return document.querySelector('#requests tr.selected') !== null")
        _save(driver, tmp_path, "dashboard-selected.png")
        for thread in threads:
            thread.join(timeout=600)
        assert sorted(len(r["choices"]) for r in results) == [1, 1, 1, 4]
        _wait(driver, "return window.dashboard.last.requests.length === 0")
        server.wait_until_idle()
        # Replay: the trace the scheduler recorded meanwhile, loaded through the page's file input.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and trace.stat().st_size == 0:
            time.sleep(0.2)
        driver.find_element("id", "trace-file").send_keys(str(trace))
        _wait(driver, "return document.getElementById('mode').textContent === 'replay'", timeout=20)
        num_frames = driver.execute_script("return window.dashboard.frames.length")
        peak = max(range(num_frames), key=lambda i: driver.execute_script(
            f"return window.dashboard.frames[{i}].blocks_used"))  # fmt: skip
        driver.execute_script(
            "const s = document.getElementById('frame'); s.value = arguments[0];"
            "s.dispatchEvent(new Event('input'));",
            peak,
        )
        assert driver.execute_script("return window.dashboard.cellCounts.used") > 0
        assert num_frames > 3
        _save(driver, tmp_path, "dashboard-replay.png")
    finally:
        driver.quit()
        server.stop()
