"""The scheduler server against hostile and failing peers, over real CURVE sockets on 127.0.0.1.

Each test names the defect it guards. Every scenario ends by checking that the scheduler still serves a
request to completion and that every KV block went back to the pool.
"""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.common.messages import (
    AbortRequest,
    ErrorKind,
    Heartbeat,
    MsgType,
    RequestError,
    RequestOutputs,
    SamplingParams,
    Shutdown,
    SubmitRequest,
)
from pagedserve.common.security import ClusterKey
from scripts.fuzz_wire import KINDS
from tests.chaos.scheduler_peers import WAIT_S, Client, Peer, ready_msg, scheduler, serve_like_a_worker

PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
LONG = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)


async def _generate(client: Client, request_id: str, params: SamplingParams = PARAMS) -> list[int]:
    await client.send(SubmitRequest(request_id, [1, 2, 3], params))
    tokens: list[int] = []
    while True:
        msg = await client.recv()
        assert isinstance(msg, RequestOutputs), msg
        for out in msg.outputs:
            assert out.request_id == request_id
            tokens += out.token_ids
            if out.finish_reason is not None:
                return tokens


async def _tokens_until_finished(client: Client) -> int:
    """The tokens of the one request in flight, counted until its output says it finished."""
    tokens = 0
    while True:
        msg = await client.recv()
        assert isinstance(msg, RequestOutputs), msg
        tokens += sum(len(o.token_ids) for o in msg.outputs)
        if any(o.finish_reason for o in msg.outputs):
            return tokens


async def _assert_serves_and_is_idle(client: Client) -> None:
    assert len(await _generate(client, "check")) == PARAMS.max_tokens
    for _ in range(int(WAIT_S / 0.05)):
        if await client.metric("pagedserve_kv_blocks_used") == 0:
            break
        await asyncio.sleep(0.05)
    assert await client.metric("pagedserve_kv_blocks_used") == 0
    assert await client.metric("pagedserve_requests_running") == 0


async def _with_worker(ctx: zmq.asyncio.Context, server, key: ClusterKey, worker_id: str = "w-1"):
    worker = Peer(ctx, server.config.worker_address, key)
    await worker.send(ready_msg(worker_id))
    return worker, asyncio.create_task(serve_like_a_worker(worker))


async def _ready(ctx: zmq.asyncio.Context, server, key: ClusterKey) -> tuple[Client, Peer, asyncio.Task]:
    """A client of `server` once a fake worker ("w-1") serves it, the worker, and the task serving."""
    client = Client(ctx, server.config.scheduler_address, key)
    worker, serving = await _with_worker(ctx, server, key)
    await client.wait_ready()
    return client, worker, serving


def test_peers_without_the_cluster_key_can_neither_submit_nor_become_the_worker(tmp_path):
    """Anyone who could reach the worker port became the worker (a fake WorkerReady was accepted, every
    user's prompt went to it in the plans) and anyone could submit."""

    async def scenario() -> None:
        async with scheduler(tmp_path) as (server, ctx, key):
            stranger_key = ClusterKey(*reversed(zmq.curve_keypair()))  # (public, secret) of another pair
            for peer_key in (None, stranger_key):  # no CURVE at all, and CURVE with another key
                fake_worker = Peer(ctx, server.config.worker_address, peer_key)
                if peer_key is not None:
                    fake_worker.sock.curve_serverkey = key.public  # it knows the server's public key
                await fake_worker.send(ready_msg("w-fake"))
                stranger = Client(ctx, server.config.scheduler_address, peer_key)
                if peer_key is not None:
                    stranger.sock.curve_serverkey = key.public
                await stranger.send(SubmitRequest("intruder", [1, 2, 3], PARAMS))
                with pytest.raises(TimeoutError):
                    await stranger.recv(timeout=1.0)  # not even a refusal: the handshake failed
                assert server.core is None and server.ready_msg is None
                fake_worker.close()
                stranger.close()
            client, worker, serving = await _ready(ctx, server, key)
            await _assert_serves_and_is_idle(client)
            serving.cancel()

    asyncio.run(scenario())


def test_a_second_worker_is_refused_while_the_first_serves(tmp_path):
    """A second WorkerReady replaced the serving worker: every in-flight request failed and the real worker
    was never taken back."""

    async def scenario() -> None:
        async with scheduler(tmp_path) as (server, ctx, key):
            client, worker, serving = await _ready(ctx, server, key)
            await client.send(SubmitRequest("in-flight", [1, 2, 3], LONG))
            second = Peer(ctx, server.config.worker_address, key)
            await second.send(ready_msg("w-2"))
            refusal = await second.recv()
            assert isinstance(refusal, Shutdown) and "another worker" in refusal.reason
            assert await _tokens_until_finished(client) == LONG.max_tokens  # it finished on the first worker
            assert server.ready_msg is not None and server.ready_msg.worker_id == "w-1"
            await _assert_serves_and_is_idle(client)
            serving.cancel()

    asyncio.run(scenario())


def test_a_client_that_disconnects_has_its_requests_aborted_and_blocks_freed(tmp_path):
    """A killed api's requests ran on to max_tokens, holding seats and KV blocks for a minute."""

    async def scenario() -> None:
        async with scheduler(tmp_path) as (server, ctx, key):
            observer, worker, serving = await _ready(ctx, server, key)
            leaving = Client(ctx, server.config.scheduler_address, key)
            for i in range(4):
                await leaving.send(SubmitRequest(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(max_tokens=240)))
            assert isinstance(await leaving.recv(), RequestOutputs)  # generating
            assert await observer.metric("pagedserve_kv_blocks_used") > 0
            leaving.close()
            for _ in range(int(WAIT_S / 0.05)):
                if await observer.metric("pagedserve_requests_running") == 0:
                    break
                await asyncio.sleep(0.05)
            assert await observer.metric("pagedserve_kv_blocks_used") == 0
            generated = await observer.metric("pagedserve_generated_tokens_total")
            assert generated < 4 * 240, "the requests ran to the end"
            await _assert_serves_and_is_idle(observer)
            serving.cancel()

    asyncio.run(scenario())


def test_a_worker_whose_connection_closes_is_dead_at_once(tmp_path):
    """/health said 200 and streams hung for up to the heartbeat timeout (10 s) after the worker was gone."""

    async def scenario() -> None:
        async with scheduler(tmp_path, heartbeat_timeout_s=3600.0) as (server, ctx, key):
            client, worker, serving = await _ready(ctx, server, key)
            await client.send(SubmitRequest("in-flight", [1, 2, 3], LONG))
            assert isinstance(await client.recv(), RequestOutputs)
            serving.cancel()
            worker.close()  # a killed process: its connection closes
            while isinstance(msg := await client.recv(timeout=5.0), RequestOutputs):
                pass
            assert isinstance(msg, RequestError) and msg.kind == ErrorKind.UNAVAILABLE
            assert "connection closed" in msg.message
            assert not (await client.info()).ready
            worker, serving = await _with_worker(ctx, server, key, "w-restarted")
            await client.wait_ready()
            await _assert_serves_and_is_idle(client)
            serving.cancel()

    asyncio.run(scenario())


def test_draining_finishes_requests_refuses_new_ones_and_stops_the_worker(tmp_path):
    """SIGTERM cut every stream in flight."""

    async def scenario() -> None:
        async with scheduler(tmp_path) as (server, ctx, key):
            client = Client(ctx, server.config.scheduler_address, key)
            worker = Peer(ctx, server.config.worker_address, key)
            await worker.send(ready_msg("w-1"))
            serving = asyncio.create_task(serve_like_a_worker(worker))
            await client.wait_ready()
            await client.send(SubmitRequest("short", [1, 2, 3], PARAMS))
            first = await client.recv()
            assert isinstance(first, RequestOutputs)  # it runs
            draining = asyncio.create_task(server.drain(timeout_s=WAIT_S))
            await asyncio.sleep(0)
            await client.send(SubmitRequest("late", [1, 2, 3], PARAMS))
            tokens, refused = sum(len(o.token_ids) for o in first.outputs), None
            while tokens < PARAMS.max_tokens or refused is None:
                msg = await client.recv()
                if isinstance(msg, RequestError):
                    refused = msg
                else:
                    tokens += sum(len(o.token_ids) for o in msg.outputs)
            assert refused.request_id == "late" and refused.kind == ErrorKind.UNAVAILABLE
            await asyncio.wait_for(draining, WAIT_S)
            await asyncio.wait_for(serving, WAIT_S)  # it ended on the Shutdown

    asyncio.run(scenario())


def test_a_request_that_breaks_the_scheduler_fails_alone(tmp_path, monkeypatch):
    """One request (beam search with length_penalty 1e308) raised inside the scheduler and ended the process
    for everyone."""

    async def scenario() -> None:
        async with scheduler(tmp_path) as (server, ctx, key):
            client, worker, serving = await _ready(ctx, server, key)
            core = server.core
            original = core.add_request

            def add_request(owner, msg):
                if msg.request_id == "poison":
                    raise OverflowError("injected")
                return original(owner, msg)

            monkeypatch.setattr(core, "add_request", add_request)
            await client.send(SubmitRequest("poison", [1, 2, 3], PARAMS))
            error = await client.recv()
            assert isinstance(error, RequestError) and error.request_id == "poison"
            assert error.kind == ErrorKind.INTERNAL
            await _assert_serves_and_is_idle(client)
            serving.cancel()

    asyncio.run(scenario())


# What a hostile peer holding the key sends: scripts/fuzz_wire.py's strategies (random frames, random msgpack
# under every type byte with str fields that are not UTF-8, and valid messages with a field of a wrong type).
_frames = st.one_of(
    KINDS["random frames"][0], KINDS["random msgpack under every type byte"][0], KINDS["wrong field type"][0]
).filter(bool)


def _hostile_frames(count: int) -> list[tuple[list[bytes], bool]]:
    """`count` hostile frame lists drawn by hypothesis, each with the port it goes to (True: workers')."""
    drawn: list[tuple[list[bytes], bool]] = []

    @settings(max_examples=count, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(_frames, st.booleans())
    def draw(frames: list[bytes], to_worker_port: bool) -> None:
        drawn.append((frames, to_worker_port))

    draw()
    return drawn


def test_random_frames_on_both_sockets_never_stop_the_scheduler(tmp_path):
    """9 of 14 crafted messages on the client port (e.g. an AbortRequest whose request id is a list) and
    random msgpack under the client type bytes killed the scheduler; later, a SubmitRequest whose request id
    was not UTF-8 crashed the code that answers undecodable submits."""
    hostile_frames = _hostile_frames(1000)
    # The one that crashed the answering of undecodable submits: a request id that is not UTF-8.
    hostile_frames.append(([bytes([MsgType.SUBMIT]), b"\x91\xa1\xc0"], False))

    async def scenario() -> None:
        async with scheduler(tmp_path) as (server, ctx, key):
            client, worker, serving = await _ready(ctx, server, key)
            await client.send(SubmitRequest("during", [1, 2, 3], LONG))
            hostile = Peer(ctx, server.config.scheduler_address, key)
            hostile_worker = Peer(ctx, server.config.worker_address, key)
            for frames, to_worker_port in hostile_frames:
                await (hostile_worker if to_worker_port else hostile).send_frames(frames)
            await client.send(AbortRequest("never-submitted"))
            await client.send(Heartbeat("not-a-worker-message"))  # a worker message on the client port
            assert await _tokens_until_finished(client) == LONG.max_tokens  # it ran through the storm
            assert server.ready_msg is not None and server.ready_msg.worker_id == "w-1"
            await _assert_serves_and_is_idle(client)
            serving.cancel()

    asyncio.run(scenario())


def test_an_undecodable_submit_is_answered_not_left_waiting(tmp_path):
    """A request the scheduler could not decode was only logged: its ZeroMQ client waited forever."""

    async def scenario() -> None:
        async with scheduler(tmp_path) as (server, ctx, key):
            client, worker, serving = await _ready(ctx, server, key)
            wire = list(SubmitRequest("typed-wrong", [1, 2, 3], PARAMS).__struct_fields__)
            assert wire[:2] == ["request_id", "prompt_token_ids"]  # the payload below is positional
            payload = ["typed-wrong", ["one", "two"], [1, 12, 0.0, 1.0, 0, None, [], True, None, [], 0, 1.0]]
            await client.send_frames([bytes([MsgType.SUBMIT]), msgpack.packb(payload)])
            error = await client.recv()
            assert isinstance(error, RequestError) and error.request_id == "typed-wrong"
            assert error.kind == ErrorKind.INVALID_REQUEST
            await _assert_serves_and_is_idle(client)
            serving.cancel()

    asyncio.run(scenario())
