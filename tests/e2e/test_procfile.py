"""The README's way to run the server: honcho on the Procfile, configured through PAGEDSERVE_* variables."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import pytest

from scripts._servers import Honcho

pytestmark = pytest.mark.e2e


def test_honcho_runs_the_procfile_serves_and_stops_on_sigterm(tiny_model_dir, tmp_path):
    stack = Honcho(tiny_model_dir, tmp_path / "honcho.log", num_kv_blocks=24)
    honcho, log_path = stack.honcho, stack.log_path
    try:
        stack.wait_healthy()
        status, body = stack.post({"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
        with urllib.request.urlopen(stack.url + "/metrics", timeout=5) as r:
            assert (
                "pagedserve_kv_blocks_total 24.0" in r.read().decode()
            )  # PAGEDSERVE_NUM_KV_BLOCKS reached it
    finally:
        os.killpg(honcho.pid, signal.SIGTERM)
        try:
            honcho.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(honcho.pid, signal.SIGKILL)
            raise
    # every process of the group is gone: nothing keeps running after honcho stops
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.killpg(honcho.pid, 0)
    text = log_path.read_text()
    for name in ("scheduler", "worker", "api"):
        assert f"{name}.1" in text
