"""Worker failure detection: the watchdog's rules, the worker's heartbeat thread, and the scheduler server
failing requests of a silent or hung worker and accepting the next one (real sockets on 127.0.0.1)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref
from collections.abc import AsyncIterator

import pytest
import zmq
import zmq.asyncio

from pagedserve.common.config import SchedulerConfig, default_cluster_key_file
from pagedserve.common.messages import (
    ErrorKind,
    Heartbeat,
    InfoReply,
    Message,
    RequestError,
    RequestOutputs,
    SamplingParams,
    Shutdown,
    StepOutput,
    StepPlan,
    SubmitRequest,
    WorkerReady,
    decode,
)
from pagedserve.common.security import load_cluster_key, secure_server
from pagedserve.common.socket_limits import Receiver, max_message_bytes
from pagedserve.common.stall import StallClock
from pagedserve.scheduler.server import SchedulerServer, WorkerWatch
from pagedserve.worker.heartbeat import HeartbeatThread
from scripts._servers import free_port
from tests.chaos.scheduler_peers import Client, Peer
from tests.scheduler.fake_worker import FakeWorker

NUM_BLOCKS, BLOCK_SIZE, VOCAB_SIZE = 64, 4, 1000
WAIT_S = 10.0  # bound on every wait: a failure shows up as a timeout, never as a hang
PARAMS = SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.0)


# -------------------------------------------------------------------------------------------------------
# the rules


def test_silence_longer_than_the_heartbeat_timeout_is_death():
    watch = WorkerWatch(heartbeat_timeout_s=2.0, step_timeout_s=60.0, last_heard=100.0)
    assert watch.death_reason(101.9) is None
    watch.heard(101.5)
    assert watch.death_reason(103.4) is None
    reason = watch.death_reason(103.6)
    assert reason is not None and "stopped responding" in reason


def test_an_unanswered_step_is_a_hang_even_while_heartbeats_arrive():
    watch = WorkerWatch(heartbeat_timeout_s=2.0, step_timeout_s=5.0, last_heard=0.0)
    watch.step_sent(1.0)
    for now in (2.0, 3.0, 4.0, 5.0, 6.0):
        watch.heard(now)
        assert watch.death_reason(now) is None
    watch.heard(6.5)
    reason = watch.death_reason(6.5)
    assert reason is not None and "did not finish a step" in reason
    watch.step_answered(6.6)
    assert watch.death_reason(7.0) is None


def test_with_two_steps_in_flight_the_second_is_timed_from_the_first_answer():
    watch = WorkerWatch(heartbeat_timeout_s=100.0, step_timeout_s=5.0, last_heard=0.0)
    watch.step_sent(1.0)
    watch.step_sent(1.5)  # async scheduling: queued behind the first at the worker
    assert watch.death_reason(5.9) is None
    watch.step_answered(5.9)  # the second one starts now
    assert watch.death_reason(10.8) is None
    reason = watch.death_reason(11.0)
    assert reason is not None and "did not finish a step" in reason
    watch.step_answered(11.0)
    assert watch.step_sent_at is None and watch.death_reason(50.0) is None


def test_a_late_tick_is_a_stall_of_this_process_and_gives_the_worker_a_whole_timeout_again():
    clock = StallClock(0.5, now=0.0)
    assert clock.tick(1.0) == 0.0 and clock.tick(1.9) == 0.0  # late by 0.5 and 0.4: jitter
    watch = WorkerWatch(heartbeat_timeout_s=2.0, step_timeout_s=5.0, last_heard=1.0)
    watch.step_sent(1.5)
    stalled = clock.tick(8.4)  # this process did not run from 1.9 to 8.4
    assert stalled == pytest.approx(6.0) and watch.death_reason(8.4) is not None
    watch.resumed(8.4, stalled)
    assert watch.death_reason(10.3) is None and not watch.step_overdue(10.3)
    assert "stopped responding" in (watch.death_reason(10.5) or "")  # still silent a timeout later
    watch.heard(10.4)
    assert watch.step_overdue(12.6) and not watch.step_overdue(12.4)  # the stall does not count


def test_heartbeat_thread_beats_with_its_worker_id_until_stopped():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    key = load_cluster_key(default_cluster_key_file())
    # (no authenticator here: the handshake alone shows the thread uses CURVE)
    secure_server(router, key, max_message_bytes(Receiver.SCHEDULER_WORKERS))
    port = router.bind_to_random_port("tcp://127.0.0.1")
    beats = HeartbeatThread(f"tcp://127.0.0.1:{port}", "w-1", interval_s=0.02, key=key).start()
    try:
        for _ in range(3):
            assert router.poll(int(WAIT_S * 1000)), "no heartbeat came"
            _, *frames = router.recv_multipart()
            assert decode(frames) == Heartbeat("w-1")
    finally:
        beats.stop()
        router.close()
        ctx.term()
    assert not beats._thread.is_alive()


# -------------------------------------------------------------------------------------------------------
# the scheduler server against a scripted worker


KEY = load_cluster_key(default_cluster_key_file())  # the scheduler servers below read the same file


def _peer(ctx: zmq.asyncio.Context, address: str) -> Peer:
    return Peer(ctx, address, KEY)


def _client(ctx: zmq.asyncio.Context, address: str) -> Client:
    return Client(ctx, address, KEY)


def _ready(worker_id: str) -> WorkerReady:
    return WorkerReady(NUM_BLOCKS, BLOCK_SIZE, 256, VOCAB_SIZE, [], "/m/fake", "fake", worker_id=worker_id)


@contextlib.asynccontextmanager
async def _scheduler(**config: float) -> AsyncIterator[tuple[SchedulerServer, zmq.asyncio.Context]]:
    cfg = SchedulerConfig(
        scheduler_address=f"tcp://127.0.0.1:{free_port()}",
        worker_address=f"tcp://127.0.0.1:{free_port()}",
        **config,  # type: ignore[arg-type]
    )
    server = SchedulerServer(cfg)
    running = asyncio.create_task(server.run())
    ctx = zmq.asyncio.Context()
    try:
        yield server, ctx
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        ctx.destroy(linger=0)


async def _serve_like_a_worker(worker: Peer, worker_id: str, beat_s: float = 0.05) -> None:
    """Answers every plan with a FakeWorker and beats while idle, until cancelled."""
    fake = FakeWorker(NUM_BLOCKS, BLOCK_SIZE, VOCAB_SIZE)
    while True:
        try:
            msg = await worker.recv(timeout=beat_s)
        except TimeoutError:
            await worker.send(Heartbeat(worker_id))
            continue
        assert isinstance(msg, StepPlan)
        await worker.send(fake.execute(msg))


async def _until_shutdown(worker: Peer) -> AsyncIterator[Message]:
    """The messages the worker gets up to a Shutdown, which must come (and comes last)."""
    while not isinstance(msg := await worker.recv(), Shutdown):
        yield msg
    yield msg


async def _generate(client: Client, request_id: str) -> list[int]:
    await client.send(SubmitRequest(request_id, [1, 2, 3], PARAMS))
    tokens: list[int] = []
    while True:
        msg = await client.recv()
        assert isinstance(msg, RequestOutputs), msg
        [out] = msg.outputs
        tokens += out.token_ids
        if out.finish_reason is not None:
            assert out.finish_reason == "length"
            return tokens


def _metric(info: InfoReply, name: str) -> float:
    [line] = [line for line in info.metrics_text.splitlines() if line.startswith(name + " ")]
    return float(line.split()[1])


async def _assert_refused_while_no_worker(client: Client) -> None:
    assert not (await client.info()).ready
    await client.send(SubmitRequest("while-dead", [1, 2], PARAMS))
    error = await client.recv()
    assert isinstance(error, RequestError) and error.kind == ErrorKind.UNAVAILABLE


async def _assert_new_worker_serves(cfg: SchedulerConfig, ctx: zmq.asyncio.Context, client: Client) -> None:
    worker = _peer(ctx, cfg.worker_address)
    await worker.send(_ready("w-new"))
    serving = asyncio.create_task(_serve_like_a_worker(worker, "w-new"))
    try:
        await client.wait_ready()
        assert len(await _generate(client, "after")) == PARAMS.max_tokens
        # Beats alone keep an idle worker alive past the timeout.
        await asyncio.sleep(3 * cfg.heartbeat_timeout_s)
        info = await client.info()
        assert info.ready
        assert _metric(info, "pagedserve_kv_blocks_used") == 0
        assert _metric(info, "pagedserve_requests_running") == 0
    finally:
        serving.cancel()
        await asyncio.gather(serving, return_exceptions=True)


# Timeouts of seconds, not fractions: on a loaded 2-core machine this process has stalled for up to 0.8 s
# (a garbage collection descheduled midway), which a 0.5 s heartbeat timeout took for a dead worker.
HEARTBEAT_TIMEOUT_S = 2.0


def test_silent_worker_fails_its_requests_then_a_new_worker_is_accepted():
    async def scenario() -> None:
        async with _scheduler(heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S) as (server, ctx):
            cfg = server.config
            client = _client(ctx, cfg.scheduler_address)
            worker = _peer(ctx, cfg.worker_address)
            impostor = _peer(ctx, cfg.worker_address)  # beats with another worker's id: no sign of life
            await worker.send(_ready("w-old"))
            await client.wait_ready()
            await client.send(SubmitRequest("in-flight", [1, 2, 3], PARAMS))
            plan = await worker.recv()
            assert isinstance(plan, StepPlan)
            old_core = weakref.ref(server.core)
            for _ in range(5):  # the worker goes silent mid-step
                await impostor.send(Heartbeat("w-other"))
                await asyncio.sleep(0.05)
            error = await client.recv()
            assert isinstance(error, RequestError) and error.request_id == "in-flight"
            assert error.kind == ErrorKind.UNAVAILABLE and "stopped responding" in error.message
            # Should it come back, it must not serve that core: after the plans queued for it (async
            # scheduling sends the next plan before the answer to the first), it is told to reset (a
            # stopped process that continues announces itself again instead of being restarted).
            *queued, shutdown = [msg async for msg in _until_shutdown(worker)]
            assert all(isinstance(msg, StepPlan) for msg in queued) and len(queued) <= 1
            assert isinstance(shutdown, Shutdown) and shutdown.reannounce
            await _assert_refused_while_no_worker(client)
            gc.collect()
            assert old_core() is None, "the dead worker's requests and KV bookkeeping are still held"
            # Its late answer is ignored: nothing reaches the client, the scheduler stays unready.
            await worker.send(FakeWorker(NUM_BLOCKS, BLOCK_SIZE, VOCAB_SIZE).execute(plan))
            await worker.send(Heartbeat("w-old"))
            await _assert_refused_while_no_worker(client)
            await _assert_new_worker_serves(cfg, ctx, client)

    asyncio.run(scenario())


def test_worker_that_beats_but_never_finishes_its_step_is_declared_hung():
    async def scenario() -> None:
        timeouts = {"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S, "step_timeout_s": 2 * HEARTBEAT_TIMEOUT_S}
        async with _scheduler(**timeouts) as (server, ctx):
            cfg = server.config
            client = _client(ctx, cfg.scheduler_address)
            worker = _peer(ctx, cfg.worker_address)
            await worker.send(_ready("w-hung"))
            await client.wait_ready()
            await client.send(SubmitRequest("in-flight", [1, 2, 3], PARAMS))
            assert isinstance(await worker.recv(), StepPlan)

            async def beat() -> None:
                while True:
                    await worker.send(Heartbeat("w-hung"))
                    await asyncio.sleep(0.05)

            beating = asyncio.create_task(beat())
            try:
                error = await client.recv()
            finally:
                beating.cancel()
                await asyncio.gather(beating, return_exceptions=True)
            assert isinstance(error, RequestError) and error.kind == ErrorKind.UNAVAILABLE
            assert "did not finish a step" in error.message
            *_, shutdown = [msg async for msg in _until_shutdown(worker)]
            assert isinstance(shutdown, Shutdown) and not shutdown.reannounce  # a hung worker is ended
            await _assert_refused_while_no_worker(client)
            await _assert_new_worker_serves(cfg, ctx, client)

    asyncio.run(scenario())


@pytest.mark.parametrize("late", [False, True], ids=["reannounced", "reannounced-then-late-output"])
def test_reannouncing_worker_fails_running_requests_and_starts_empty(late: bool):
    async def scenario() -> None:
        async with _scheduler() as (server, ctx):
            cfg = server.config
            client = _client(ctx, cfg.scheduler_address)
            worker = _peer(ctx, cfg.worker_address)
            await worker.send(_ready("w-1"))
            await client.wait_ready()
            await client.send(SubmitRequest("in-flight", [1, 2, 3], PARAMS))
            plan = await worker.recv()
            assert isinstance(plan, StepPlan)
            # The same worker from a new connection (it reconnected and reset itself); another worker id
            # would be refused while this one lives (tests/chaos/test_scheduler_server.py).
            restarted = _peer(ctx, cfg.worker_address)
            await restarted.send(_ready("w-1"))
            error = await client.recv()
            assert isinstance(error, RequestError) and error.kind == ErrorKind.UNAVAILABLE
            if late:  # the old process's answer to step 0 must not be taken for the new core's step 0
                await worker.send(StepOutput(plan.step_id, [0], [7], [None]))
            serving = asyncio.create_task(_serve_like_a_worker(restarted, "w-1"))
            try:
                assert len(await _generate(client, "after")) == PARAMS.max_tokens
                assert _metric(await client.info(), "pagedserve_kv_blocks_used") == 0
            finally:
                serving.cancel()
                await asyncio.gather(serving, return_exceptions=True)

    asyncio.run(scenario())
