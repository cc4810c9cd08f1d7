"""The ZeroMQ client library notices a scheduler that exits (its connection closes) or hangs (it stops
answering while requests are in flight), and fails the requests in flight with UNAVAILABLE instead of
waiting forever.

Defect guarded: a dead scheduler went unnoticed; streams in flight hung with no error for 70 s and more, and
new requests hung instead of getting 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from pagedserve.client import AsyncEngineClient, RequestRejected
from pagedserve.common.messages import ErrorKind, SamplingParams, SubmitRequest, decode
from pagedserve.common.security import authenticate, load_cluster_key, secure_server
from pagedserve.common.socket_limits import Receiver, max_message_bytes

PARAMS = SamplingParams(max_tokens=4)


@contextlib.asynccontextmanager
async def _silent_scheduler(
    key_file: Path, **client_options: float
) -> AsyncIterator[tuple[zmq.asyncio.Socket, AsyncEngineClient]]:
    """A CURVE ROUTER with the cluster key that takes connections and answers nothing, and a client of it
    with `client_options`."""
    key = load_cluster_key(key_file)
    ctx = zmq.asyncio.Context()
    auth = authenticate(ctx, key)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_server(sock, key, max_message_bytes(Receiver.SCHEDULER_CLIENTS))
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    address = f"tcp://127.0.0.1:{port}"
    client = AsyncEngineClient(address, detokenize=False, cluster_key_file=str(key_file), **client_options)
    try:
        yield sock, client
    finally:
        await client.close()
        auth.stop()
        ctx.destroy(linger=0)


def test_a_scheduler_that_stops_answering_fails_the_requests_in_flight(tmp_path):
    async def scenario() -> None:
        async with _silent_scheduler(tmp_path / "key", liveness_timeout_s=1.5) as (sock, client):
            [handle] = await client.submit([1, 2, 3], PARAMS)
            _, *frames = await asyncio.wait_for(sock.recv_multipart(), 5)
            assert isinstance(decode(frames), SubmitRequest)  # it arrived; nothing will answer
            started = time.monotonic()
            with pytest.raises(RequestRejected) as info:
                await asyncio.wait_for(handle.result(), 10)
            assert info.value.kind == ErrorKind.UNAVAILABLE and "did not answer" in info.value.message
            assert time.monotonic() - started < 1.5 + 3  # the timeout, plus one ping period and slack

    asyncio.run(scenario())


def test_a_scheduler_that_exits_fails_the_requests_at_once_and_new_ones_are_refused(tmp_path):
    async def scenario() -> None:
        async with _silent_scheduler(tmp_path / "key", info_timeout=1.0) as (sock, client):
            [handle] = await client.submit([1, 2, 3], PARAMS)
            await asyncio.wait_for(sock.recv_multipart(), 5)
            started = time.monotonic()
            sock.close()  # the scheduler process exits: its connection closes
            with pytest.raises(RequestRejected) as info:
                await asyncio.wait_for(handle.result(), 10)
            assert info.value.kind == ErrorKind.UNAVAILABLE and "went away" in info.value.message
            assert time.monotonic() - started < 2.0  # seen on the connection, not by a timeout
            assert not client.connected
            with pytest.raises(RequestRejected) as refused:
                await client.submit([1, 2, 3], PARAMS)
            assert refused.value.kind == ErrorKind.UNAVAILABLE

    asyncio.run(scenario())
