"""vllm-router (PyPI, Rust; a consumer no one here wrote) routes by our KV events: a real pagedserve stack
with --kv-events-config and a mock replica behind `vllm-router --policy kv_aware`; the prompt whose prefix the
real replica caches goes to it, credited with the cached tokens in the router's own decision log."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from pagedserve.common.kv_events_config import KVEventsConfig
from pagedserve.scheduler.kv_events.publisher import ZmqEventPublisher
from scripts._servers import Honcho, free_port

pytestmark = pytest.mark.e2e
ROUTER = Path(sys.executable).parent / "vllm-router"
BLOCK_SIZE = 16  # the worker's default --block-size


class _Mock(BaseHTTPRequestHandler):
    """A replica that answers everything with "mock", so that a test sees where the router sent a request."""

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply({})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply(
            {"id": "mock", "object": "text_completion", "model": "mock", "choices": [{"text": "mock"}]}
        )

    def log_message(self, *args: object) -> None:
        pass


def _decisions(log: Path) -> list[dict[str, str]]:
    """The router's kv_aware decision lines, as their key=value fields."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
    lines = [line for line in text.splitlines() if "KV prefix decision" in line]
    return [dict(re.findall(r'(\w+)="?([^" ]+)"?', line)) for line in lines]


def _post(port: int, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.status, json.loads(reply.read())


def _wait(what: str, check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


def test_vllm_router_credits_the_prefix_a_replica_announced(tiny_model_dir, tmp_path):
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    # (no topic: vllm-router's static sources subscribe to vLLM's default, the empty topic)
    config = {"enable_kv_cache_events": True, "endpoint": events, "replay_endpoint": replay}
    stack = Honcho(tiny_model_dir, tmp_path / "stack.log", kv_events_config=json.dumps(config))
    mock = ThreadingHTTPServer(("127.0.0.1", 0), _Mock)
    threading.Thread(target=mock.serve_forever, daemon=True).start()
    mock_url = f"http://127.0.0.1:{mock.server_port}"
    mock_events = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{free_port()}"))
    router_port, router_log = free_port(), tmp_path / "router.log"
    router = None
    try:
        stack.wait_healthy()
        with open(router_log, "wb") as log:
            router = subprocess.Popen(
                [
                    str(ROUTER), "--host", "127.0.0.1", "--port", str(router_port),
                    "--prometheus-port", str(free_port()), "--log-level", "debug",
                    "--worker-urls", mock_url, stack.url, "--policy", "kv_aware",
                    "--kv-event-source", f"{stack.url}={events}",
                    "--kv-event-replay-source", f"{stack.url}={replay}",
                    "--kv-event-source", f"{mock_url}={mock_events.endpoint}",
                    "--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", "tiny",
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        _wait(
            "the router's subscription",
            lambda: f"spawned subscriber rank0 (instance {stack.url})" in router_log.read_text(),
        )
        time.sleep(1.0)  # a PUB socket sends nothing to a subscriber whose subscription has not arrived yet
        prompt = list(range(100, 100 + 4 * BLOCK_SIZE))  # four full blocks
        status, _ = stack.post({"prompt": [*prompt, 7], "max_tokens": 1})  # straight to the replica: cached
        assert status == 200
        _wait(
            "the router to read the stored blocks",
            lambda: f"source={stack.url}" in re.sub(r"\x1b\[[0-9;]*m", "", router_log.read_text()),
        )
        status, body = _post(router_port, {"prompt": [*prompt, 8, 9], "max_tokens": 1})
        assert status == 200 and body["model"] != "mock"  # the replica that caches the prefix answered
        status, body = _post(router_port, {"prompt": list(range(900, 900 + 3 * BLOCK_SIZE)), "max_tokens": 1})
        assert status == 200
        first, fresh = _decisions(router_log)  # one decision per request through the router
        assert first["worker"] == stack.url and int(first["credited_prefix_tokens"]) == 4 * BLOCK_SIZE
        assert int(fresh["credited_prefix_tokens"]) == 0  # nothing announced it
    finally:
        if router is not None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(10)
        mock.shutdown()
        mock_events.close()
        stack.stop()
