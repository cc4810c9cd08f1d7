"""A streaming client that stops reading cannot make the api buffer without bound (issue 20: +117 MB in
60 s for one n=128 stream): past max_buffered_tokens unread, or stream_write_timeout_s without taking data,
its request is aborted at the scheduler and its connection ended."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from typing import Any

from pagedserve.api.state import STATE
from pagedserve.client.request_stream import RequestHandle, SequenceDelta, _RequestState
from pagedserve.common.config import ApiConfig
from pagedserve.common.messages import SamplingParams, SeqOutput
from tests.api.harness import ApiServer, wait_until
from tests.api.test_disconnect import assert_aborted

BIG_MODEL = {"max_model_len": 8192, "num_kv_blocks": 8192}  # room for long streams in the fake


def open_unread_stream(server: ApiServer, body: dict[str, Any]) -> socket.socket:
    """Sends a streaming request from a socket with a tiny receive window, and reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    data = json.dumps({**body, "stream": True}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
    assert wait_until(lambda: bool(server.fake.submits()))
    return sock


def read_to_end(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or resets) the connection."""
    sock.settimeout(10)
    received = b""
    try:
        while chunk := sock.recv(1 << 16):
            received += chunk
    except ConnectionResetError:
        pass
    return received


def buffered_tokens(server: ApiServer) -> int:
    generations = list(server.background.run(_in_flight(server)))
    return sum(h.num_buffered_tokens for g in generations for h in g.handles)


async def _in_flight(server: ApiServer) -> list[Any]:
    return list(server._runner.app[STATE].in_flight)


def test_a_client_that_reads_nothing_is_aborted_when_its_buffer_fills(make_server: Any) -> None:
    config = ApiConfig(max_buffered_tokens=512, stream_write_timeout_s=60.0)
    server = make_server(config, send_buffer=4096, step_delay=0.001, **BIG_MODEL)
    sock = open_unread_stream(server, {"prompt": "abc", "max_tokens": 8000, "n": 64})
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, buffered_tokens(server))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        assert_aborted(server)
    finally:
        stop.set()
        sampler.join()
    assert peak <= 512 + 2 * 64  # the bound, and what one scheduler message can add before the abort
    assert read_to_end(sock).startswith(b"HTTP/1.1 200")  # ended: the server closed the connection
    assert wait_until(lambda: buffered_tokens(server) == 0 and not server.background.run(_in_flight(server)))
    assert server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2}).status == 200


def test_a_client_that_takes_nothing_for_the_write_timeout_is_aborted(make_server: Any) -> None:
    config = ApiConfig(max_buffered_tokens=10**9, stream_write_timeout_s=0.5)
    server = make_server(config, send_buffer=4096, step_delay=0.005, **BIG_MODEL)
    sock = open_unread_stream(server, {"prompt": "abc", "max_tokens": 8000, "n": 16})
    assert_aborted(server)
    assert read_to_end(sock).startswith(b"HTTP/1.1 200")
    assert server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2}).status == 200


def test_a_reading_client_gets_its_whole_stream_under_a_small_bound(make_server: Any) -> None:
    server = make_server(ApiConfig(max_buffered_tokens=256), step_delay=0.001, **BIG_MODEL)
    body = {"prompt": "abc", "max_tokens": 300, "n": 4, "stream_options": {"include_usage": True}}
    events = server.stream("/v1/completions", body)
    assert events[-1]["usage"]["completion_tokens"] == 4 * 300
    finished = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finished == ["length"] * 4
    assert not server.fake.aborts()


def _state(n: int = 2) -> _RequestState:
    return _RequestState("r", [1, 2, 3], SamplingParams(n=n), None)


def _out(index: int, token: int, finish: str | None = None) -> SeqOutput:
    return SeqOutput("r", index, [token], None, finish, 3, 0)


def test_request_stream_bound_is_opt_in_and_reported_once() -> None:
    async def scenario() -> None:
        state = _state()
        handle = RequestHandle(state, lambda _: None)
        for k in range(100):  # unbounded by default: ZeroMQ clients keep their behaviour
            state.on_output(_out(k % 2, k))
        assert handle.num_buffered_tokens == 100
        calls: list[int] = []
        handle.limit_buffer(101, lambda: calls.append(handle.num_buffered_tokens))
        for k in range(5):
            state.on_output(_out(k % 2, k))
        await asyncio.sleep(0)
        assert calls == [105]  # once, from the loop, after the output that passed the bound
        delta = await anext(handle)
        assert isinstance(delta, SequenceDelta) and handle.num_buffered_tokens == 104

    asyncio.run(scenario())


def test_interrupt_goes_ahead_of_queued_deltas_and_aborts() -> None:
    async def scenario() -> None:
        state = _state()
        aborted: list[str] = []
        handle = RequestHandle(state, aborted.append)
        state.on_output(_out(0, 7))
        handle.interrupt(RuntimeError("shutting down"))
        try:
            await anext(handle)
        except RuntimeError as e:
            assert str(e) == "shutting down"
        else:
            raise AssertionError("the interrupt did not come first")
        assert aborted == ["r"]
        assert await anext(handle, None) is None

    asyncio.run(scenario())
