"""deploy/kubernetes/replicas/ checks API keys at the replicas and runs vllm-router without a key of its
own: that holds only while the router passes each client's `Authorization` header on to the replica, for
kv_aware's render call as for the request itself, and probes /health without one. Checked against
vllm-router itself (requirements-dev.txt's pin), with a stand-in replica that records what it is sent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from scripts._servers import free_port

pytestmark = pytest.mark.e2e
ROUTER = Path(sys.executable).parent / "vllm-router"
CHAT = {"id": "c", "object": "chat.completion", "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}]}  # fmt: skip


class _Replica(BaseHTTPRequestHandler):
    """Answers as a replica would enough for the router, and records (method, path, Authorization)."""

    seen: list[tuple[str, str, str | None]] = []

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.command, self.path, self.headers.get("Authorization")))
        body = {"token_ids": [1, 2, 3]} if self.path.endswith("/render") else CHAT
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def router(tmp_path: Path) -> Iterator[int]:
    replica = ThreadingHTTPServer(("127.0.0.1", 0), _Replica)
    threading.Thread(target=replica.serve_forever, daemon=True).start()
    url, port = f"http://127.0.0.1:{replica.server_port}", free_port()
    argv = [str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", url,
            "--policy", "kv_aware", "--kv-event-source", f"{url}=tcp://127.0.0.1:{free_port()}",
            "--kv-event-model", "m", "--prometheus-port", str(free_port()),
            "--health-check-endpoint", "/health"]  # fmt: skip
    with (tmp_path / "router.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield port
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        replica.shutdown()


def _chat(port: int) -> int:
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello"}]}).encode()
    headers = {"Content-Type": "application/json", "Authorization": "Bearer client-key"}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body, headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status
    except OSError:
        return 0


def test_the_router_passes_the_clients_key_to_the_replica(router: int) -> None:
    deadline = time.monotonic() + 30
    while _chat(router) != 200:  # the router starts, finds its replica healthy, then serves
        assert time.monotonic() < deadline, _Replica.seen
        time.sleep(0.2)
    seen = list(_Replica.seen)
    assert ("POST", "/v1/chat/completions/render", "Bearer client-key") in seen  # kv_aware's prompt tokens
    assert ("POST", "/v1/chat/completions", "Bearer client-key") in seen
    assert {auth for method, path, auth in seen if path == "/health"} == {None}  # /health needs no key
