"""What a peer can make a process hold over ZeroMQ is bounded by its socket's MAXMSGSIZE (the largest
legitimate message, common/socket_limits.py), before and after authentication, and the largest legitimate
messages still pass.

Defect guarded: the scheduler's sockets set no MAXMSGSIZE. A peer without the cluster key that claimed a
500 MB frame during the CURVE handshake and sent 400 MB raised the scheduler from 71 to 471 MiB in 0.7 s,
held for the 30 s handshake timeout; three such connections took it to 971 MiB.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.messages import RequestError, SubmitRequest, decode, encode
from pagedserve.common.socket_limits import HANDSHAKE_IVL_MS, Receiver, WireLimits, max_message_bytes
from pagedserve.common.wire_types import MAX_INT32
from tests.chaos.maximal_messages import (
    maximal_params,
    maximal_request_outputs,
    maximal_step_output,
    maximal_step_plan,
)
from tests.chaos.scheduler_peers import Client, scheduler
from tests.chaos.scheduler_process import SchedulerProcess, scheduler_process

CLAIMED = 500_000_000  # the frame size the attacker announces
SENT = 150 << 20  # what it sends of it on each socket, at most (a few hundred MB in all)
# ZMTP 3.0 greeting of a CURVE client: signature, version 3.0, mechanism, as-server 0, filler
GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"CURVE".ljust(20, b"\x00") + b"\x00" * 32


def _claim_a_huge_frame(port: int) -> int:
    """Speaks the ZMTP greeting without any key, then announces a CLAIMED-byte command frame and sends up
    to SENT bytes of it; returns what was sent before the scheduler closed the connection."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(GREETING)
        conn.recv(64)  # the scheduler's greeting
        chunk = b"\x00" * (1 << 20)
        try:
            conn.sendall(b"\x06" + struct.pack(">Q", CLAIMED))  # long command frame
            while sent < SENT:
                conn.sendall(chunk)
                sent += len(chunk)
        except OSError:  # reset: the scheduler refused the frame
            pass
        time.sleep(0.5)  # (the old scheduler kept reading what was sent into the frame it had allocated)
    return sent


@pytest.fixture(scope="module")
def sched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SchedulerProcess]:
    with scheduler_process(tmp_path_factory.mktemp("scheduler")) as process:
        time.sleep(1.0)  # let its start-up allocations settle
        yield process


@pytest.mark.e2e
def test_an_unauthenticated_oversized_frame_costs_the_scheduler_no_memory(sched: SchedulerProcess):
    before = sched.rss_bytes()
    for port in (sched.scheduler_port, sched.worker_port):
        _claim_a_huge_frame(port)
    grown = sched.rss_bytes() - before
    assert grown < 4 << 20, f"the scheduler grew by {grown / 2**20:.0f} MiB"
    assert sched.proc.poll() is None


@pytest.mark.e2e
def test_a_peer_that_does_not_finish_its_handshake_is_dropped_within_seconds(sched: SchedulerProcess):
    """(Before: held for libzmq's default 30 s, with whatever frame it had claimed.)"""
    with socket.create_connection(("127.0.0.1", sched.scheduler_port), timeout=10) as conn:
        conn.sendall(GREETING)
        conn.recv(64)  # the scheduler's greeting
        conn.sendall(b"\x06" + struct.pack(">Q", 1000) + b"\x00" * 500)  # half a HELLO, then nothing
        started = time.monotonic()
        conn.settimeout(HANDSHAKE_IVL_MS / 1000 + 3)
        try:
            while conn.recv(4096):
                pass
        except ConnectionResetError:
            pass
        except TimeoutError:
            pytest.fail("the half-finished handshake was still held")
        assert time.monotonic() - started >= HANDSHAKE_IVL_MS / 1000 - 1  # dropped by the timer, not at once


def test_the_default_limits_bound_an_unauthenticated_connection_to_a_few_mib_for_seconds():
    limits = WireLimits.of_scheduler(SchedulerConfig())
    for receiver in (Receiver.SCHEDULER_CLIENTS, Receiver.SCHEDULER_WORKERS):
        assert max_message_bytes(receiver, limits) < 16 << 20  # what docs/reliability.md states
    assert HANDSHAKE_IVL_MS <= 5000


SMALL = WireLimits(
    max_model_len=512,
    max_num_seqs=4,
    max_num_batched_tokens=256,
    block_size=1,
    draft_budget=8,
    max_waiting_seqs=8,
)


@pytest.mark.parametrize(
    ("receiver", "build"),
    [
        (Receiver.SCHEDULER_WORKERS, maximal_step_output),
        (Receiver.WORKER, maximal_step_plan),
        (Receiver.CLIENT, maximal_request_outputs),
        (
            Receiver.SCHEDULER_CLIENTS,
            lambda limits: SubmitRequest(
                "r" * 256, [MAX_INT32] * limits.tokens, maximal_params(), 2**63 - 1, "\U0001f600" * 4096
            ),
        ),
    ],
)
def test_the_largest_legitimate_messages_fit_their_receivers_limit(receiver, build):
    msg = build(SMALL)
    frames = encode(msg)
    decode(frames)  # legitimate: inside every bound of the wire
    assert len(frames[1]) <= max_message_bytes(receiver, SMALL)


@pytest.mark.parametrize("max_model_len", [4096])
def test_a_maximal_request_passes_the_scheduler_and_a_larger_frame_is_dropped(tmp_path, max_model_len):
    async def scenario() -> None:
        async with scheduler(tmp_path, max_model_len=max_model_len) as (server, ctx, key):
            client = Client(ctx, server.config.scheduler_address, key)
            await client.info()
            tokens = [MAX_INT32] * max_model_len
            request = SubmitRequest("r" * 256, tokens, maximal_params(), 2**63 - 1, "\U0001f600" * 4096)
            limit = max_message_bytes(Receiver.SCHEDULER_CLIENTS, server._limits)
            assert len(encode(request)[1]) > limit // 2  # it is large, and it passes
            await client.send(request)
            answer = await client.recv()
            assert isinstance(answer, RequestError) and answer.request_id == "r" * 256  # no worker yet
            # A frame over the limit closes the connection before it is read: no answer comes.
            too_long = SubmitRequest("big", [1] * (limit // 5 + 1), maximal_params())
            assert len(encode(too_long)[1]) > limit
            await client.send(too_long)
            with pytest.raises(TimeoutError):
                await client.recv(timeout=2.0)
            client.close()

    asyncio.run(scenario())
