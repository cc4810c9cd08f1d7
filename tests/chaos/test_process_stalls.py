"""A process paused (SIGSTOP, then SIGCONT) for three times the heartbeat timeout serves again right after
the resume, and no process is restarted.

Defect guarded: a scheduler stopped for 20 s declared the heartbeating worker dead the moment it continued
(its watchdog judged before reading the beats that waited in its socket) and shut the worker down: service
came back 17.6 s after the resume, a worker restart later. A worker stopped that long was told to exit.
(The client's own watch: tests/chaos/test_client_quiet_and_stalls.py.)
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import zmq.asyncio

from pagedserve.common.messages import (
    RequestError,
    RequestOutputs,
    SamplingParams,
    StepPlan,
    SubmitRequest,
)
from pagedserve.common.security import load_cluster_key
from pagedserve.worker.heartbeat import HeartbeatThread
from scripts._servers import ROOT
from tests.chaos.scheduler_peers import Client, Peer, ready_msg, scheduler
from tests.chaos.scheduler_process import scheduler_process
from tests.scheduler.fake_worker import FakeWorker

pytestmark = pytest.mark.e2e
HEARTBEAT_TIMEOUT_S = 2.0
STOP_S = 3 * HEARTBEAT_TIMEOUT_S
PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


async def _served(client: Client, request_id: str, timeout: float = 10.0) -> None:
    """Submits a request and waits until it finishes normally."""
    await client.send(SubmitRequest(request_id, [1, 2, 3], PARAMS))
    deadline = time.monotonic() + timeout
    while True:
        msg = await client.recv(max(0.01, deadline - time.monotonic()))
        assert not isinstance(msg, RequestError), msg
        if isinstance(msg, RequestOutputs) and any(
            o.request_id == request_id and o.finish_reason for o in msg.outputs
        ):
            return


async def _wait_ready(client: Client, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not (await client.info()).ready:
        assert time.monotonic() < deadline, "the scheduler never had a ready worker"
        await asyncio.sleep(0.05)


def test_a_stopped_scheduler_keeps_its_worker_and_serves_right_after_the_resume(tmp_path: Path):
    with scheduler_process(tmp_path, "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S)) as sched:
        key = load_cluster_key(sched.key_file)

        async def scenario() -> None:
            ctx = zmq.asyncio.Context()
            worker = Peer(ctx, sched.worker_address, key)
            worker_id = uuid.uuid4().hex
            beats = HeartbeatThread(sched.worker_address, worker_id, 0.2, key).start()
            plans = 0
            said: list[object] = []

            async def serve() -> None:
                nonlocal plans
                fake = FakeWorker(64, 4, 1000)
                while True:
                    msg = await worker.recv(timeout=3600)
                    if not isinstance(msg, StepPlan):
                        said.append(msg)  # Shutdown: the scheduler gave the worker up
                        continue
                    plans += 1
                    await worker.send(fake.execute(msg))

            serving = asyncio.create_task(serve())
            try:
                await worker.send(ready_msg(worker_id))
                client = Client(ctx, sched.scheduler_address, key)
                await _wait_ready(client, 30)
                await _served(client, "before")
                sched.proc.send_signal(signal.SIGSTOP)
                await asyncio.sleep(STOP_S)  # the worker beats on meanwhile
                sched.proc.send_signal(signal.SIGCONT)
                await _served(client, "after", timeout=5.0)
                await asyncio.sleep(4 * 0.5)  # a few watchdog periods: a verdict would come by now
                await _served(client, "later", timeout=5.0)
                assert said == [] and plans >= 3
                assert "worker_dead" not in sched.logs() and "scheduler_stalled" in sched.logs()
            finally:
                serving.cancel()
                beats.stop()
                ctx.destroy(linger=0)

        asyncio.run(scenario())


def test_a_stopped_worker_is_not_restarted_and_serves_right_after_the_resume(tiny_model_dir, tmp_path):
    async def scenario() -> None:
        config = {"heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S}
        async with scheduler(tmp_path, **config) as (server, ctx, key):
            env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
            env.update(
                PAGEDSERVE_MODEL=str(tiny_model_dir),
                PAGEDSERVE_WORKER_ADDRESS=server.config.worker_address,
                PAGEDSERVE_CLUSTER_KEY_FILE=str(tmp_path / "cluster_key"),
                PAGEDSERVE_DEVICE="cpu",
                PAGEDSERVE_NUM_KV_BLOCKS="32",
                PAGEDSERVE_HEARTBEAT_INTERVAL_S="0.3",
            )
            with open(tmp_path / "worker.log", "wb") as log:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "pagedserve.worker"], cwd=ROOT, env=env, stdout=log, stderr=log
                )
            try:
                client = Client(ctx, server.config.scheduler_address, key)
                await _wait_ready(client, 120)  # loading the model on a busy machine
                assert server.ready_msg is not None
                worker_id = server.ready_msg.worker_id
                await _served(client, "before", timeout=60)
                proc.send_signal(signal.SIGSTOP)
                await asyncio.sleep(STOP_S)  # declared dead meanwhile: it is silent
                assert server.ready_msg is None
                proc.send_signal(signal.SIGCONT)
                await _wait_ready(client, 10)  # it announces itself again at once
                await _served(client, "after", timeout=30)
                assert proc.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
                assert server.ready_msg is not None and server.ready_msg.worker_id == worker_id  # no restart
            finally:
                proc.kill()
                proc.wait()

    asyncio.run(scenario())
