"""SIGTERM drains the api: admission stops (503), requests in flight get shutdown_timeout_s to finish, the
rest end with an error event and [DONE] (streams) or a 503, and the process exits 0 (issue 20: SIGTERM cut
streams with no error event and no [DONE]). The access log says why a request failed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from pagedserve.api.server import drain
from pagedserve.api.state import STATE
from scripts._servers import ROOT, free_port
from tests.api.fake_scheduler import FakeScheduler
from tests.api.harness import ApiServer, BackgroundLoop, HttpReply, parse_sse, wait_until
from tests.api.test_backpressure import read_to_end
from tests.api.test_disconnect import open_request, read_until
from tests.api.test_errors import assert_error

LONG = {"prompt": "abc", "max_tokens": 200}  # 4 s at the fake's 20 ms a step


def in_thread(call: Any) -> tuple[threading.Thread, list[Any]]:
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(call()))
    thread.start()
    return thread, result


def start_drain(server: ApiServer, timeout_s: float) -> asyncio.Future[int]:
    app = server._runner.app
    return asyncio.run_coroutine_threadsafe(drain(app, timeout_s), server.background.loop)  # type: ignore[return-value]


def test_drain_refuses_new_requests_and_ends_the_rest_with_errors(make_server: Any) -> None:
    server: ApiServer = make_server(step_delay=0.02)
    streamed, stream_reply = in_thread(lambda: server.post("/v1/completions", {**LONG, "stream": True}))
    whole, whole_reply = in_thread(lambda: server.post("/v1/completions", LONG))
    assert wait_until(lambda: server.fake.num_running == 2)
    drained = start_drain(server, timeout_s=0.3)
    assert wait_until(lambda: server._runner.app[STATE].draining)
    error = assert_error(server.post("/v1/completions", LONG), 503, "service_unavailable")
    assert "shutting down" in error["message"]
    assert_error(server.post("/v1/chat/completions", {"messages": []}), 503, "service_unavailable")
    health = server.get("/health")
    assert health.status == 503 and health.json()["status"] == "shutting down"
    assert drained.result(timeout=10) == 2
    streamed.join(10)
    whole.join(10)
    events = parse_sse(stream_reply[0].text)  # ends with [DONE]
    assert events[-1]["error"]["type"] == "service_unavailable"
    assert "shutting down" in events[-1]["error"]["message"]
    assert_error(whole_reply[0], 503, "service_unavailable")
    request_ids = {s.request_id for s in server.fake.submits()}
    assert wait_until(lambda: {a.request_id for a in server.fake.aborts()} == request_ids)


def test_drain_lets_requests_in_flight_finish(make_server: Any) -> None:
    server: ApiServer = make_server(step_delay=0.02)
    streamed, stream_reply = in_thread(lambda: server.post("/v1/completions", {**LONG, "max_tokens": 10}))
    assert wait_until(lambda: server.fake.num_running == 1)
    assert start_drain(server, timeout_s=10).result(timeout=15) == 0
    streamed.join(10)
    reply: HttpReply = stream_reply[0]
    assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 10
    assert not server.fake.aborts()


def test_sigterm_drains_python_m_api_and_exits_0(tiny_model_dir: Path) -> None:
    background = BackgroundLoop()
    fake = background.run(FakeScheduler(model_root=str(tiny_model_dir), step_delay=0.02).start())
    port = free_port()
    argv = [sys.executable, "-m", "pagedserve.api", "--port", str(port), "--scheduler-address", fake.address]
    argv += ["--shutdown-timeout-s", "0.5"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=dict(os.environ), stderr=subprocess.PIPE, text=True)
    try:
        server = ApiServer.__new__(ApiServer)  # only its request helpers, against the subprocess
        server.port = port
        assert wait_until(lambda: _status(server, "/health") == 200, timeout=60)
        assert server.post("/v1/completions", {"prompt": "abc", "n": 0}).status == 400
        sock = open_request(server, "/v1/completions", {**LONG, "stream": True})  # type: ignore[arg-type]
        assert b"data: " in read_until(sock, b"data: ")
        proc.send_signal(signal.SIGTERM)
        received = read_to_end(sock).decode()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=30)
        background.run(fake.stop())
        background.close()
    assert proc.returncode == 0, stderr
    # Chunked: the error event, then [DONE], then the last chunk
    assert received.endswith("data: [DONE]\n\n\r\n0\r\n\r\n")
    error_event = received.split("data: ")[-2].split("\n\n")[0]
    assert json.loads(error_event)["error"]["message"] == "the server is shutting down"
    lines = [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]
    assert [line["ended_in_flight"] for line in lines if line.get("event") == "api_stopping"] == [1]
    access = [line for line in lines if line.get("event") == "request"]
    refused, streamed = access  # one line each; /health probes are at debug
    assert refused["status"] == 400 and refused["error"] == "'n' must be between 1 and 128, got 0"
    assert streamed["status"] == 200 and streamed["error"] == "the server is shutting down"
    assert streamed["completion_tokens"] > 0 and streamed["latency_s"] > 0


def _status(server: ApiServer, path: str) -> int | None:
    try:
        return server.get(path).status
    except OSError:
        return None
