"""A real worker process against a scripted scheduler (a CURVE ROUTER on 127.0.0.1): it refuses a plan that
does not match its state without dying, and it rejoins a scheduler that restarted on the same address.

Defects guarded: a plan the worker could not apply ended the process (`step_failed`, exit 1); a restarted
scheduler never got the existing worker back.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from pagedserve.common.messages import (
    Heartbeat,
    Message,
    NewSequence,
    SamplingParams,
    Shutdown,
    StepOutput,
    StepPlan,
    WorkerReady,
    decode,
    encode,
)
from pagedserve.common.security import ClusterKey, load_cluster_key, secure_server
from pagedserve.common.socket_limits import Receiver, max_message_bytes
from scripts._servers import ROOT, free_port

pytestmark = pytest.mark.e2e
WAIT_MS = 120_000  # loading the model on a busy machine; a failure shows as a timeout, never a hang


class Scheduler:
    """A CURVE ROUTER bound where the worker connects (no authenticator: the handshake needs the key)."""

    def __init__(self, address: str, key: ClusterKey) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_server(self.sock, key, max_message_bytes(Receiver.SCHEDULER_WORKERS))
        self.sock.bind(address)
        self.worker: bytes | None = None

    def recv(self, timeout_ms: int = WAIT_MS) -> Message:
        """The worker's next message but heartbeats: they come over a connection of their own (another
        identity), and one may slip out before the long interval these tests set starts."""
        while True:
            assert self.sock.poll(timeout_ms), "the worker sent nothing"
            sender, *frames = self.sock.recv_multipart()
            msg = decode(frames)
            if not isinstance(msg, Heartbeat):
                self.worker = sender
                return msg

    def send(self, msg: Message) -> None:
        assert self.worker is not None
        self.sock.send_multipart([self.worker, *encode(msg)])

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


def _plan(step_id: int, seq_id: int, num_blocks: int) -> StepPlan:
    new = NewSequence(seq_id, [1, 2, 3, 4], [num_blocks - 1], 0, SamplingParams(temperature=0.0), 7)
    return StepPlan(step_id, [], [new], [], [seq_id], [4], [seq_id])


@pytest.fixture
def worker(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, ClusterKey, subprocess.Popen]]:
    address = f"tcp://127.0.0.1:{free_port()}"
    key_file = tmp_path / "cluster_key"
    key = load_cluster_key(key_file)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env.update(
        PAGEDSERVE_MODEL=str(tiny_model_dir),
        PAGEDSERVE_WORKER_ADDRESS=address,
        PAGEDSERVE_CLUSTER_KEY_FILE=str(key_file),
        PAGEDSERVE_DEVICE="cpu",
        PAGEDSERVE_NUM_KV_BLOCKS="32",
        PAGEDSERVE_HEARTBEAT_INTERVAL_S="60",  # no beats on the ROUTER these tests read
    )
    log = open(tmp_path / "worker.log", "wb")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.worker"], cwd=ROOT, env=env, stdout=log, stderr=log
    )
    try:
        yield address, key, proc
    finally:
        proc.kill()
        proc.wait()
        log.close()


def _ready(scheduler: Scheduler) -> WorkerReady:
    while not isinstance(msg := scheduler.recv(), WorkerReady):
        pass  # a stale step output queued before the reconnection
    return msg


def test_a_plan_that_does_not_match_makes_the_worker_reannounce_not_die(worker):
    address, key, proc = worker
    scheduler = Scheduler(address, key)
    try:
        ready = _ready(scheduler)
        scheduler.send(_plan(0, seq_id=0, num_blocks=ready.num_kv_blocks))
        out = scheduler.recv()
        assert isinstance(out, StepOutput) and out.seq_ids == [0]
        scheduler.send(_plan(1, seq_id=0, num_blocks=ready.num_kv_blocks))  # seq 0 exists: refused
        again = _ready(scheduler)
        assert again.worker_id == ready.worker_id and proc.poll() is None
        # It forgot everything: seq 0 is new again, and is served.
        scheduler.send(_plan(0, seq_id=0, num_blocks=ready.num_kv_blocks))
        out = scheduler.recv()
        assert isinstance(out, StepOutput) and out.seq_ids == [0]
        scheduler.send(Shutdown("done"))
        assert proc.wait(timeout=30) == 0
    finally:
        scheduler.close()


def test_the_worker_rejoins_a_scheduler_that_restarted(worker):
    address, key, proc = worker
    first = Scheduler(address, key)
    try:
        ready = _ready(first)
        first.send(_plan(0, seq_id=5, num_blocks=ready.num_kv_blocks))
        assert isinstance(first.recv(), StepOutput)
    finally:
        first.close()  # the scheduler process exits
    second = Scheduler(address, key)
    try:
        again = _ready(second)  # the worker reconnects and announces itself, with nothing kept
        assert again.worker_id == ready.worker_id and proc.poll() is None
        second.send(_plan(0, seq_id=5, num_blocks=again.num_kv_blocks))  # seq 5 is unknown again
        out = second.recv()
        assert isinstance(out, StepOutput) and out.seq_ids == [5]
    finally:
        second.close()
