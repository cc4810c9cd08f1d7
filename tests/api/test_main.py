"""`python -m pagedserve.api` starts, serves in front of a (fake) scheduler, logs JSON lines and stops on
SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from scripts._servers import ROOT, free_port
from tests.api.fake_scheduler import FakeScheduler
from tests.api.harness import BackgroundLoop, HttpReply, wait_until


def test_python_m_api_serves_and_logs(tiny_model_dir: Path) -> None:
    import http.client

    background = BackgroundLoop()
    fake = background.run(FakeScheduler(model_root=str(tiny_model_dir), model_name="tiny").start())
    port = free_port()
    env = {**os.environ, "PAGEDSERVE_SERVED_MODEL_NAME": "served-name"}  # the environment sets fields too
    argv = [sys.executable, "-m", "pagedserve.api", "--port", str(port), "--scheduler-address", fake.address]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)

    def request(method: str, path: str, body: object = None) -> HttpReply | None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            conn.request(method, path, body=None if body is None else json.dumps(body))
            response = conn.getresponse()
            return HttpReply(
                response.status, response.getheader("Content-Type") or "", response.read().decode()
            )
        except OSError:
            return None
        finally:
            conn.close()

    try:
        assert wait_until(lambda: getattr(request("GET", "/health"), "status", None) == 200, timeout=60)
        reply = request("POST", "/v1/completions", {"model": "served-name", "prompt": "hi", "max_tokens": 3})
        assert reply is not None and reply.status == 200 and reply.json()["model"] == "served-name"
        response_id = reply.json()["id"]
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        background.run(fake.stop())
        background.close()
    assert proc.returncode == 0, stderr
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    [logged] = [line for line in lines if line.get("event") == "request"]
    assert logged["response_id"] == response_id and logged["status"] == 200 and logged["process"] == "api"
    assert logged["prompt_tokens"] == 2 and logged["completion_tokens"] == 3 and logged["latency_s"] >= 0
