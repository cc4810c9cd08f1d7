"""A client that goes away mid-request gets its request aborted at the scheduler, freeing its KV blocks."""

from __future__ import annotations

import json
import socket
from typing import Any

from pagedserve.common.messages import AbortRequest
from tests.api.harness import ApiServer, wait_until


def open_request(server: ApiServer, path: str, body: dict[str, Any]) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    data = json.dumps(body).encode()
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_until(sock: socket.socket, marker: bytes, limit: int = 1 << 20) -> bytes:
    received = b""
    while marker not in received and len(received) < limit:
        chunk = sock.recv(4096)
        if not chunk:
            break
        received += chunk
    return received


def assert_aborted(server: ApiServer) -> None:
    request_id = server.fake.submits()[-1].request_id
    assert wait_until(lambda: AbortRequest(request_id) in server.fake.aborts())
    assert wait_until(lambda: server.fake.num_running == 0)


def test_disconnect_mid_stream_aborts_the_request(make_server: Any) -> None:
    server = make_server(step_delay=0.02)
    sock = open_request(
        server, "/v1/completions", {"prompt": "abc", "max_tokens": 200, "n": 2, "stream": True}
    )
    assert b"data: " in read_until(sock, b"data: ")
    sock.close()
    assert_aborted(server)
    assert server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2}).status == 200


def test_disconnect_during_a_chat_stream_aborts_the_request(make_server: Any) -> None:
    server = make_server(step_delay=0.02)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 200, "stream": True}
    sock = open_request(server, "/v1/chat/completions", body)
    assert b"data: " in read_until(sock, b"data: ")
    sock.close()
    assert_aborted(server)


def test_disconnect_before_a_full_response_aborts_the_request(make_server: Any) -> None:
    server = make_server(step_delay=0.02)
    sock = open_request(server, "/v1/completions", {"prompt": "abc", "max_tokens": 200})
    assert wait_until(lambda: server.fake.num_running == 1)
    sock.close()
    assert_aborted(server)


def test_finished_requests_send_no_abort(make_server: Any) -> None:
    server = make_server()
    assert server.post("/v1/completions", {"prompt": "abc", "max_tokens": 3, "n": 2}).status == 200
    assert len(server.stream("/v1/completions", {"prompt": [1, 2], "max_tokens": 3})) == 3
    assert not wait_until(lambda: bool(server.fake.aborts()), timeout=0.2)
