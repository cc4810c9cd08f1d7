"""How the scheduler tells that a peer is gone: the worker's silence (WorkerWatch), and closed connections.

A worker declared dead by its silence alone (a stopped process, perhaps) is told to reset, not to exit: if
it continues, it announces itself again at once instead of being restarted. A watchdog tick that comes late
means that the scheduler itself was not running (stopped, starved, its loop blocked: common/stall.py): the
worker's messages of that time wait unread, so the watch starts afresh instead of judging.

The scheduler's ROUTER sockets see identities, not connections; the socket monitor sees connections (their
file descriptors), not identities. Each received message carries the descriptor it came over (ZMQ_SRCFD),
which ties the two: a DISCONNECTED event for a descriptor means its peers are gone, at once, with no
heartbeat timeout to wait for. (libzmq's ROUTER_NOTIFY would say this directly, but it is a draft option that
pyzmq's wheels do not build.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagedserve.common.monitor import open_monitor
from pagedserve.common.stall import StallClock

log = structlog.get_logger(process="scheduler")


@dataclass
class WorkerWatch:
    """When the worker was last heard from and since when a step waits for it: decides when it is dead.

    Plain bookkeeping on the caller's clock, so that the rules are testable without sockets or sleeps.
    """

    heartbeat_timeout_s: float  # silence (no heartbeat, no step output) that counts as death
    step_timeout_s: float  # a step unanswered this long counts as a hung worker (group)
    last_heard: float  # the last heartbeat, step output or announcement
    step_sent_at: float | None = None  # since when the oldest unanswered step runs; None between steps
    steps_in_flight: int = 0

    def heard(self, now: float) -> None:
        self.last_heard = now

    def step_sent(self, now: float) -> None:
        if self.steps_in_flight == 0:
            self.step_sent_at = now
        self.steps_in_flight += 1

    def step_answered(self, now: float) -> None:
        """The oldest step in flight answered: the next one (the worker runs them in order) starts now."""
        self.steps_in_flight = max(0, self.steps_in_flight - 1)
        self.step_sent_at = now if self.steps_in_flight else None
        self.last_heard = now

    def resumed(self, now: float, stalled_s: float) -> None:
        """The scheduler itself was not running for the last `stalled_s` (common/stall.py): what the worker
        sent meanwhile waits unread, so it gets a whole heartbeat timeout from now, and the stall does not
        count against the step in flight."""
        self.last_heard = max(self.last_heard, now)
        if self.step_sent_at is not None:
            self.step_sent_at += stalled_s

    def step_overdue(self, now: float) -> bool:
        return self.step_sent_at is not None and now - self.step_sent_at > self.step_timeout_s

    def death_reason(self, now: float) -> str | None:
        """Why the worker counts as dead at `now`, or None while it does not."""
        silent = now - self.last_heard
        if silent > self.heartbeat_timeout_s:
            return f"the worker stopped responding (nothing heard from it for {silent:.1f} s)"
        if self.step_overdue(now):
            return f"the worker did not finish a step within {self.step_timeout_s:g} s"
        return None


async def watch_worker(
    timeout_s: float,
    current: Callable[[], WorkerWatch | None],
    workers: zmq.asyncio.Socket,
    declare_dead: Callable[..., None],
) -> None:
    """A few times per `timeout_s` (the watch's shortest), judges the `current()` worker's watch and calls
    `declare_dead(reason, reset=...)` when the worker counts as dead, until cancelled."""
    period_s = min(1.0, max(0.01, timeout_s / 4))
    clock = StallClock(period_s, time.monotonic())
    while True:
        await asyncio.sleep(period_s)
        now = time.monotonic()
        stalled = clock.tick(now)
        watch = current()
        if watch is None:
            continue
        if stalled:
            log.warning("scheduler_stalled", stalled_s=round(stalled, 1))
            watch.resumed(now, stalled)
            continue
        reason = watch.death_reason(now)
        if reason is None:
            continue
        if workers.get(zmq.EVENTS) & zmq.POLLIN:
            continue  # worker messages wait to be read (this loop was busy): judge once they are
        # silence alone: a stopped worker, which may continue; a step overdue: a hung one, which won't
        declare_dead(reason, reset=not watch.step_overdue(now))


class PeerConnections:
    """identity <-> connection descriptor, for the peers that sent something over a live connection."""

    def __init__(self) -> None:
        self._fd_of: dict[bytes, int] = {}
        self._peers_on: dict[int, set[bytes]] = {}

    def seen(self, identity: bytes, fd: int) -> None:
        old = self._fd_of.get(identity)
        if old == fd:
            return
        if old is not None:
            self._peers_on[old].discard(identity)
        self._fd_of[identity] = fd
        self._peers_on.setdefault(fd, set()).add(identity)

    def disconnected(self, fd: int) -> set[bytes]:
        """Forgets the connection `fd` and returns the identities that spoke over it."""
        peers = self._peers_on.pop(fd, set())
        for identity in peers:
            self._fd_of.pop(identity, None)
        return peers

    def __len__(self) -> int:
        return len(self._fd_of)


def source_fd(frame: zmq.Frame) -> int:
    """The descriptor of the connection `frame` arrived over."""
    return frame.get(zmq.SRCFD)


async def watch_disconnects(
    sock: zmq.asyncio.Socket, peers: PeerConnections, on_gone: Callable[[bytes], None]
) -> None:
    """Calls `on_gone(identity)` for every peer of every connection of `sock` that closes, until cancelled.

    A descriptor can be reused by a new connection before its old one's event is read here; the new peer
    would then be reported gone by mistake. The window is one event-loop turn, and every caller's reaction
    to a wrong report is one a real disconnect would also cause (a re-announce, an aborted request).
    """
    monitor = open_monitor(sock, zmq.EVENT_DISCONNECTED)
    try:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            for identity in peers.disconnected(int(event["value"])):
                on_gone(identity)
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
