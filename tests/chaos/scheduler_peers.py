"""An in-process scheduler server on 127.0.0.1 and DEALER peers that speak to it, with or without the key."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import zmq
import zmq.asyncio

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.messages import InfoReply, InfoRequest, Message, StepPlan, WorkerReady, decode, encode
from pagedserve.common.security import ClusterKey, load_cluster_key, secure_client
from pagedserve.common.socket_limits import Receiver, max_message_bytes
from pagedserve.scheduler.server import SchedulerServer
from scripts._servers import free_port
from tests.scheduler.fake_worker import FakeWorker

NUM_BLOCKS, BLOCK_SIZE, VOCAB_SIZE = 64, 4, 1000
WAIT_S = 10.0  # bound on every wait: a failure shows up as a timeout, never as a hang


class Peer:
    """A DEALER socket speaking our messages, with bounded receives; CURVE-secured when given a key."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, key: ClusterKey | None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if key is not None:
            secure_client(self.sock, key, max_message_bytes(Receiver.CLIENT))
        self.sock.connect(address)

    async def send(self, msg: Message) -> None:
        await self.sock.send_multipart(encode(msg))

    async def send_frames(self, frames: list[bytes]) -> None:
        await self.sock.send_multipart(frames)

    async def recv(self, timeout: float = WAIT_S) -> Message:
        return decode(await asyncio.wait_for(self.sock.recv_multipart(), timeout))

    def close(self) -> None:
        self.sock.close(linger=0)


class Client(Peer):
    _query_ids = itertools.count()

    async def info(self, timeout: float = WAIT_S) -> InfoReply:
        query_id = next(self._query_ids)
        await self.send(InfoRequest(query_id))
        while True:  # outputs of requests may come first
            msg = await self.recv(timeout)
            if isinstance(msg, InfoReply) and msg.query_id == query_id:
                return msg

    async def wait_ready(self, ready: bool = True) -> InfoReply:
        for _ in range(int(WAIT_S / 0.02)):
            info = await self.info()
            if info.ready == ready:
                return info
            await asyncio.sleep(0.02)
        raise AssertionError(f"the scheduler never became ready={ready}")

    async def metric(self, name: str) -> float:
        text = (await self.info()).metrics_text
        [line] = [line for line in text.splitlines() if line.startswith(name + " ")]
        return float(line.split()[1])


def ready_msg(worker_id: str) -> WorkerReady:
    return WorkerReady(NUM_BLOCKS, BLOCK_SIZE, 256, VOCAB_SIZE, [], "/m/fake", "fake", worker_id=worker_id)


@contextlib.asynccontextmanager
async def scheduler(
    key_dir: Path, **config: float
) -> AsyncIterator[tuple[SchedulerServer, zmq.asyncio.Context, ClusterKey]]:
    """A running SchedulerServer with a key of its own in `key_dir`; yields it, a context, and the key."""
    key = load_cluster_key(key_dir / "cluster_key")
    cfg = SchedulerConfig(
        scheduler_address=f"tcp://127.0.0.1:{free_port()}",
        worker_address=f"tcp://127.0.0.1:{free_port()}",
        cluster_key_file=str(key_dir / "cluster_key"),
        **config,  # type: ignore[arg-type]
    )
    server = SchedulerServer(cfg, key)
    running = asyncio.create_task(server.run())
    ctx = zmq.asyncio.Context()
    try:
        yield server, ctx, key
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running
        ctx.destroy(linger=0)


async def serve_like_a_worker(worker: Peer) -> None:
    """Answers every plan with a FakeWorker until cancelled (other messages, e.g. Shutdown, end it)."""
    fake = FakeWorker(NUM_BLOCKS, BLOCK_SIZE, VOCAB_SIZE)
    while True:
        msg = await worker.recv(timeout=3600)
        if not isinstance(msg, StepPlan):
            return
        await worker.send(fake.execute(msg))
