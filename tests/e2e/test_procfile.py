"""The README's way to run the server: honcho on the Procfile, configured through PAGEDSERVE_* variables."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.e2e.processes import ROOT, free_port

pytestmark = pytest.mark.e2e


def test_honcho_runs_the_procfile_serves_and_stops_on_sigterm(tiny_model_dir, tmp_path):
    port = free_port()
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env.update(
        PATH=f"{bin_dir}:{env.get('PATH', '')}",
        PAGEDSERVE_MODEL=str(tiny_model_dir),
        PAGEDSERVE_PORT=str(port),
        PAGEDSERVE_SCHEDULER_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
        PAGEDSERVE_WORKER_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
        PAGEDSERVE_NUM_KV_BLOCKS="24",
        PAGEDSERVE_DEVICE="cpu",
        PYTHONUNBUFFERED="1",
    )
    log_path = tmp_path / "honcho.log"
    with open(log_path, "wb") as log:
        honcho = subprocess.Popen(
            [str(bin_dir / "honcho"), "start"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert honcho.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        body = json.dumps({"prompt": "Hello", "max_tokens": 3, "ignore_eos": True}).encode()
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 3
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            assert "pagedserve_kv_blocks_total 24" in r.read().decode()  # PAGEDSERVE_NUM_KV_BLOCKS reached it
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
