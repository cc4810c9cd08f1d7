"""Slow, idle and flooding HTTP clients against the api's connection deadlines and cap (api/limits.py).

Each test names the defect it guards (issue 35, item 3): with no header or body deadline, a keep-alive of
3,630 s and no cap on connections, 20,000 sockets that each sent one byte held the api at its
file-descriptor limit (every new client, /health included, was reset), and a body trickled one byte every
5 s stayed open for good. The app runs in front of a fake scheduler; counts and times are small.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.api.limits import GUARD
from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer, wait_until

KEY = "sk-limits-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
CAP, RESERVE = 100, 10
IDLE_SOCKETS = 300  # three times the cap


@pytest.fixture(scope="module")
def capped(tiny_model_dir: Path) -> Iterator[ApiServer]:
    """A small cap and long deadlines: what frees room here is the cap, not a timeout."""
    config = ApiConfig(
        api_key=KEY,
        max_connections=CAP,
        connection_reserve=RESERVE,
        header_timeout_s=60,
        keepalive_timeout_s=60,
    )
    api = ApiServer(str(tiny_model_dir), config)
    yield api
    api.close()


@pytest.fixture(scope="module")
def quick(tiny_model_dir: Path) -> Iterator[ApiServer]:
    """Short deadlines, so that each one passes within a test."""
    config = ApiConfig(header_timeout_s=0.5, body_timeout_s=1.0, keepalive_timeout_s=0.5)
    api = ApiServer(str(tiny_model_dir), config)
    yield api
    api.close()


def _open(port: int, first: bytes = b"G") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    if first:
        sock.sendall(first)
    return sock


def _is_closed(sock: socket.socket) -> bool:
    """Whether the server has closed `sock` (EOF or reset), without waiting."""
    sock.setblocking(False)
    try:
        return sock.recv(1 << 16) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True
    finally:
        sock.setblocking(True)


def _closed_within(sock: socket.socket, timeout: float) -> float | None:
    """Seconds until the server closed `sock`, reading whatever it sends first; None if it did not."""
    start = time.monotonic()
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic() - start


def _get(port: int, path: str, headers: dict[str, str] | None = None) -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path, headers=headers or {})
    response = conn.getresponse()
    response.read()
    conn.close()
    return response


def test_idle_sockets_past_the_cap_are_displaced_and_health_still_answers(capped: ApiServer) -> None:
    """Guards: sockets that each sent one byte were held without limit (20,000 took the api to its
    file-descriptor limit and every new client, /health included, got a reset). Now at most
    max_connections are held, the new displacing the longest-waiting, and /health answers throughout."""
    # An authenticated client's keep-alive connection, made before the flood.
    kept = http.client.HTTPConnection("127.0.0.1", capped.port, timeout=10)
    kept.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}), AUTH)
    first = kept.getresponse()
    assert first.status == 200 and first.read()
    idle = [_open(capped.port) for _ in range(IDLE_SOCKETS)]
    try:
        assert wait_until(lambda: sum(_is_closed(s) for s in idle) >= IDLE_SOCKETS - CAP, timeout=10)
        guard = capped._runner.app[GUARD]
        assert guard.num_connections <= CAP
        for _ in range(5):  # each a new connection, past the soft cap
            health = _get(capped.port, "/health")
            assert health.status == 200
        # Unauthenticated connections go first: the authenticated client's connection is still open.
        kept.request("POST", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": 2}), AUTH)
        reply = kept.getresponse()
        assert reply.status == 200 and json.loads(reply.read())["choices"]
        # Past the soft cap, a request without the key gets its 401 and its connection closed.
        refused = _get(capped.port, "/v1/models")
        assert refused.status == 401 and refused.getheader("Connection") == "close"
        assert guard.closed["displaced"] >= IDLE_SOCKETS - CAP
    finally:
        kept.close()
        for sock in idle:
            sock.close()


def test_when_every_connection_holds_a_request_the_new_one_is_closed(capped: ApiServer) -> None:
    """The cap holds even when nothing can be displaced: a connection past it is closed at once, not
    left to wait on a full table. (Requests in progress are simulated by marking connections busy.)"""
    guard = capped._runner.app[GUARD]
    assert wait_until(lambda: guard.num_connections == 0, timeout=10)
    held = [_open(capped.port, b"") for _ in range(CAP)]
    try:
        assert wait_until(lambda: guard.num_connections == CAP)
        # Mark them busy (as a request in progress would), so that none may be displaced.
        capped.background.loop.call_soon_threadsafe(_mark_all_busy, guard)
        assert wait_until(lambda: len(guard._busy) == CAP)
        extra = _open(capped.port, b"")
        assert _closed_within(extra, 5) is not None
        assert all(not _is_closed(s) for s in held)
        extra.close()
    finally:
        for sock in held:
            sock.close()
    assert wait_until(lambda: guard.num_connections == 0, timeout=10)


def _mark_all_busy(guard: object) -> None:
    untrusted = guard._untrusted  # type: ignore[attr-defined]
    busy = guard._busy  # type: ignore[attr-defined]
    while untrusted:
        transport, conn = untrusted.popitem()
        conn.phase, conn.deadline = "busy", None
        busy[transport] = conn


def test_headers_sent_a_byte_at_a_time_are_cut_at_the_header_timeout(quick: ApiServer) -> None:
    """Guards: no deadline for a request's headers (slowloris): a connection that sends a header byte
    now and then was held for good."""
    sock = _open(quick.port, b"GET /health HTTP/1.1\r\n")
    start = time.monotonic()
    closed = None
    for _ in range(20):  # a byte every 0.1 s: each resets no timer
        try:
            sock.sendall(b"X")
        except OSError:
            closed = time.monotonic() - start
            break
        if _is_closed(sock):
            closed = time.monotonic() - start
            break
        time.sleep(0.1)
    sock.close()
    assert closed is not None and closed < 1.5, closed
    assert _get(quick.port, "/health").status == 200


def test_a_trickled_body_gets_408_and_is_closed_at_the_body_timeout(quick: ApiServer) -> None:
    """Guards: a body trickled one byte every 5 s stayed open indefinitely. Now its request gets a 408
    in the API's error shape once body_timeout_s has passed, and its connection is closed."""
    sock = _open(quick.port, b"")
    headers = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(headers + b"Content-Length: 1000\r\n\r\n{")
    start = time.monotonic()
    received = b""
    sock.settimeout(0.2)
    while time.monotonic() - start < 4 and not received.endswith(b"}"):
        try:
            sock.sendall(b" ")
            chunk = sock.recv(1 << 16)
        except TimeoutError:
            continue
        except OSError:
            break
        if not chunk:
            break
        received += chunk
    elapsed = time.monotonic() - start
    assert _closed_within(sock, 3) is not None
    sock.close()
    assert received.startswith(b"HTTP/1.1 408"), received[:200]
    error = json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "body_timeout" and set(error) == {"message", "type", "param", "code"}
    assert 0.9 < elapsed < 3, elapsed
    assert _get(quick.port, "/health").status == 200


def test_an_idle_keep_alive_connection_is_closed_after_keepalive_timeout(quick: ApiServer) -> None:
    """Guards: the keep-alive of 3,630 s, which let idle connections pile up for an hour."""
    sock = _open(quick.port, b"")
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    sock.settimeout(5)
    assert sock.recv(1 << 16).startswith(b"HTTP/1.1 200")
    closed = _closed_within(sock, 5)
    sock.close()
    assert closed is not None and 0.3 < closed < 2, closed


def test_a_connection_that_sends_nothing_is_closed_at_the_header_timeout(quick: ApiServer) -> None:
    """Guards: a socket that connects and sends nothing was held until the keep-alive of 3,630 s."""
    sock = _open(quick.port, b"")
    closed = _closed_within(sock, 5)
    sock.close()
    assert closed is not None and closed < 1.5, closed


def test_past_the_soft_cap_of_requests_only_health_and_metrics_are_served(tiny_model_dir: Path) -> None:
    """Guards the reserve: with every connection but the reserve holding a request in progress, a new
    generation request gets 503 at once while /health still answers (before, nothing was kept for it)."""
    config = ApiConfig(max_connections=8, connection_reserve=4)
    api = ApiServer(str(tiny_model_dir), config, step_delay=0.1)
    streams = []
    try:
        assert wait_until(lambda: api.get("/health").status == 200, timeout=30)
        body = json.dumps({"prompt": "hi", "max_tokens": 100, "stream": True}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        streams = [_open(api.port, head + body) for _ in range(4)]  # 4 = the soft cap: 8 - 4
        guard = api._runner.app[GUARD]
        assert wait_until(lambda: guard.in_progress == 4)
        refused = api.post("/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert refused.status == 503 and refused.json()["error"]["type"] == "service_unavailable"
        assert api.get("/health").status == 200
        for sock in streams:
            sock.close()
        assert wait_until(lambda: guard.in_progress == 0, timeout=10)
        assert api.post("/v1/completions", {"prompt": "hi", "max_tokens": 2}).status == 200
    finally:
        for sock in streams:
            sock.close()
        api.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"header_timeout_s": 0},
        {"body_timeout_s": -1},
        {"keepalive_timeout_s": 0},
        {"max_connections": 10, "connection_reserve": 10},
        {"connection_reserve": -1},
        {"tokenizer_threads": 0},
        {"max_response_tokens": 0},
    ],
)
def test_limits_out_of_range_are_refused_at_start(fields: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        ApiConfig(**fields)  # type: ignore[arg-type]
