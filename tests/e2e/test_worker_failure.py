"""A worker that dies (kill -9) or hangs (SIGSTOP) mid-generation, through the real processes: its requests
end with an error, new ones get 503 until a worker is back, and a restarted worker serves, no KV leaked."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from pagedserve.client import EngineClient, RequestRejected
from pagedserve.common.messages import ErrorKind, SamplingParams
from tests.e2e.processes import Server, start_server

pytestmark = pytest.mark.e2e

HEARTBEAT_TIMEOUT_S = 2.0
WAIT_S = 20.0  # bound on every wait for the server: a missed detection fails, it never hangs the suite
LONG = {"prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    srv = start_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        num_kv_blocks=256,
        max_num_seqs=8,
        heartbeat_interval_s=0.2,
        heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S,
    )
    yield srv
    srv.stop()


def _post(server: Server, body: dict, timeout: float = WAIT_S):
    req = urllib.request.Request(
        server.url + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    return urllib.request.urlopen(req, timeout=timeout)


def _status(server: Server, body: dict) -> tuple[int, dict]:
    try:
        with _post(server, body) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _events(response) -> Iterator[dict | str]:
    """The SSE events of a streamed response as they come: parsed JSON, or "[DONE]"."""
    for line in response:
        if line.startswith(b"data: "):
            data = line[len(b"data: ") :].strip()
            yield "[DONE]" if data == b"[DONE]" else json.loads(data)


def _wait_for_health(server: Server, status: int) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        if server.get("/health")[0] == status:
            return
        time.sleep(0.1)
    raise AssertionError(f"/health never became {status}: {server.get('/health')}")


def _assert_unavailable_until_a_worker_is_back(server: Server) -> None:
    _wait_for_health(server, 503)
    assert server.get("/v1/models")[0] == 503
    status, body = _status(server, {"prompt": "Hello", "max_tokens": 4})
    assert status == 503 and body["error"]["type"] == ErrorKind.UNAVAILABLE
    with EngineClient(server.scheduler_address) as client:
        handle = client.submit_one([1, 2, 3], SamplingParams(max_tokens=4))
        with pytest.raises(RequestRejected) as info:
            handle.result(timeout=WAIT_S)
        assert info.value.kind == ErrorKind.UNAVAILABLE


def _restart_worker_and_assert_it_serves(server: Server) -> None:
    server.engine.start("worker")
    deadline = time.monotonic() + 120  # loading the model
    while server.get("/health")[0] != 200:
        server.engine.check_alive()
        assert time.monotonic() < deadline, server.logs("worker")
        time.sleep(0.2)
    status, body = _status(server, {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    assert server.get("/v1/models")[0] == 200
    server.wait_until_idle()
    assert server.metric("pagedserve_kv_blocks_used") == 0


def test_killed_worker_ends_the_stream_with_an_error_and_a_restarted_one_serves(server):
    worker = server.procs["worker"]
    with _post(server, LONG) as response:
        events = _events(response)
        first = next(events)
        assert isinstance(first, dict) and "choices" in first  # generating
        worker.send_signal(signal.SIGKILL)
        rest = list(events)  # the socket timeout bounds each read
    assert rest[-1] == "[DONE]"
    [error] = [e for e in rest if isinstance(e, dict) and "error" in e]
    assert error["error"]["type"] == ErrorKind.UNAVAILABLE
    assert "connection closed" in error["error"]["message"]  # seen at once, not after the heartbeat timeout
    generated = sum(len(e["choices"][0]["text"]) > 0 for e in rest if isinstance(e, dict) and "choices" in e)
    assert generated < LONG["max_tokens"]
    assert worker.wait(timeout=WAIT_S) == -signal.SIGKILL
    _assert_unavailable_until_a_worker_is_back(server)
    _restart_worker_and_assert_it_serves(server)


def test_stopped_worker_is_declared_dead_and_rejoins_once_continued(server):
    """A worker silent past the heartbeat timeout (stopped) has its requests failed; continued, it is not
    restarted: the scheduler told it to forget its sequences, and it announces itself again and serves."""
    worker = server.procs["worker"]
    with EngineClient(server.scheduler_address) as client:
        handle = client.submit_one([5] * 20, SamplingParams(max_tokens=2000, ignore_eos=True))
        deltas = iter(handle)
        assert next(deltas).token_ids  # generating
        os.kill(worker.pid, signal.SIGSTOP)  # heartbeats stop with it
        try:
            with pytest.raises(RequestRejected) as info:
                handle.result(timeout=WAIT_S)
            assert info.value.kind == ErrorKind.UNAVAILABLE
            _assert_unavailable_until_a_worker_is_back(server)
        finally:
            os.kill(worker.pid, signal.SIGCONT)
    _wait_for_health(server, 200)  # the same process, announced again
    assert worker.poll() is None
    status, body = _status(server, {"prompt": "Hello", "max_tokens": 8, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 8
    server.wait_until_idle()
    assert server.metric("pagedserve_kv_blocks_used") == 0
    assert "declared dead" in server.logs("worker")
    _restart_worker_and_assert_it_serves(server)
