"""The client's connection to the scheduler: one ZeroMQ DEALER socket, the requests in flight on it, and the
watch over the scheduler's health.

One receive task decodes what the scheduler sends and hands each sequence's outputs to its request's state
(client/request_stream.py), which detokenizes them and checks stop strings on the way. The socket is a CURVE
client holding the cluster key (common/security.py), without which the scheduler refuses the connection.

The connection watches the scheduler: when its connection closes (its process exited), every request in
flight fails at once with UNAVAILABLE, and so do new ones until it is back (ZeroMQ reconnects by itself);
when the scheduler owes an answer and stays silent (a hung process) for `liveness_timeout_s`, the requests
in flight fail the same way. The silence counts from when an answer was owed: the scheduler's last message,
or the first request sent after it, whichever is later (after a quiet spell the last message is old, and
says nothing about a scheduler that was just asked). A keep-alive tick that comes late means that this
process was not running (common/stall.py): the timeout then starts afresh, once what arrived is read.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pagedserve.client.errors import ClientClosed, RequestRejected
from pagedserve.client.request_stream import _RequestState
from pagedserve.common.log import get_logger
from pagedserve.common.messages import (
    AbortRequest,
    CodecError,
    ErrorKind,
    InfoReply,
    InfoRequest,
    KVSnapshot,
    KVSnapshotRequest,
    Message,
    RequestError,
    RequestOutputs,
    decode,
    encode,
)
from pagedserve.common.monitor import open_monitor
from pagedserve.common.security import load_cluster_key, secure_client
from pagedserve.common.socket_limits import Receiver, max_message_bytes
from pagedserve.common.stall import StallClock

log = get_logger(component="client")
# The keep-alive's period, at most: with requests in flight and an answer owed for a period, it asks for info
LIVENESS_PING_S = 1.0
CONNECTION_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


class SchedulerConnection:
    """One DEALER socket to the scheduler and the requests in flight on it; use from one asyncio event loop.

    It is the one owner of the table of requests in flight: the client adds a request before sending it,
    and the connection drops it when it finishes, is refused, is aborted, or is lost with the scheduler.
    """

    def __init__(
        self, address: str, *, cluster_key_file: str, info_timeout: float, liveness_timeout_s: float
    ) -> None:
        self.address = address
        self._key_file = cluster_key_file
        self._info_timeout = info_timeout
        self._liveness_timeout_s = liveness_timeout_s
        self._connected = asyncio.Event()  # the scheduler's connection is up (handshake done)
        self._last_heard = 0.0  # monotonic time of the scheduler's last message
        # monotonic time of the first request sent since the last message heard (None: none since): from
        # then on the scheduler owes an answer, whatever the silence before it
        self._sent_into_silence: float | None = None
        self._rearmed_at = 0.0  # when the keep-alive last found that this process had stalled
        self._query_counter = itertools.count()
        self._requests: dict[str, _RequestState] = {}
        self._info_waiters: dict[int, asyncio.Future] = {}  # query id -> its InfoReply or KVSnapshot
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []  # receiving, watching the connection, liveness pings
        self._closed = False

    async def start(self) -> None:
        """Connects the socket and starts the receive task, once; raises ClientClosed after `close`."""
        if self._closed:
            raise ClientClosed("the client is closed")
        if self._socket is not None:
            return
        key = await asyncio.to_thread(load_cluster_key, self._key_file)
        socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)  # long enough to deliver the aborts that close() sends
        # No high-water marks: a dropped output would leave its request waiting forever.
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        secure_client(socket, key, max_message_bytes(Receiver.CLIENT))
        monitor = open_monitor(socket, CONNECTION_EVENTS)
        socket.connect(self.address)
        self._socket = socket
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="engine-client-receive"),
            asyncio.create_task(self._watch_connection(monitor), name="engine-client-connection"),
            asyncio.create_task(self._keep_alive(), name="engine-client-liveness"),
        ]

    @property
    def connected(self) -> bool:
        """Whether the scheduler's connection is up (it may still be hung: see `liveness_timeout_s`)."""
        return self._connected.is_set()

    @property
    def num_unfinished(self) -> int:
        return len(self._requests)

    async def wait_connected(self) -> None:
        """Waits for the scheduler's connection; raises RequestRejected (UNAVAILABLE) after `info_timeout`."""
        try:
            await asyncio.wait_for(self._connected.wait(), self._info_timeout)
        except TimeoutError:
            raise RequestRejected(ErrorKind.UNAVAILABLE, "the scheduler is not reachable") from None

    async def send_request(self, state: _RequestState, msg: Message) -> None:
        """Sends a request's submission, its state in flight from now on (so no output can miss it)."""
        assert self._socket is not None
        self._requests[state.request_id] = state
        if self._sent_into_silence is None:
            self._sent_into_silence = time.monotonic()
        await self._socket.send_multipart(encode(msg))

    def _send_nowait(self, msg: Message) -> None:
        assert self._socket is not None
        future = self._socket.send_multipart(encode(msg))
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception not retrieved"

    def abort(self, request_id: str) -> None:
        """Ends a request in flight here (its unfinished sequences with "abort") and at the scheduler."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        state.abort_locally()
        if self._socket is not None and not self._closed:
            self._send_nowait(AbortRequest(request_id))

    async def info(self, timeout: float | None = None) -> InfoReply:
        """Asks the scheduler for its state. Raises TimeoutError when it does not answer in time."""
        await self.start()
        query_id = next(self._query_counter)
        waiter: asyncio.Future[InfoReply] = asyncio.get_running_loop().create_future()
        self._info_waiters[query_id] = waiter
        try:
            self._send_nowait(InfoRequest(query_id))
            return await asyncio.wait_for(waiter, self._info_timeout if timeout is None else timeout)
        finally:
            self._info_waiters.pop(query_id, None)

    async def kv_snapshot(self, max_cells: int, timeout: float | None = None) -> KVSnapshot:
        """Asks the scheduler for a picture of its KV pool. Raises TimeoutError when it does not answer."""
        await self.start()
        query_id = next(self._query_counter)
        waiter: asyncio.Future[KVSnapshot] = asyncio.get_running_loop().create_future()
        self._info_waiters[query_id] = waiter
        try:
            self._send_nowait(KVSnapshotRequest(query_id, max_cells))
            return await asyncio.wait_for(waiter, self._info_timeout if timeout is None else timeout)
        finally:
            self._info_waiters.pop(query_id, None)

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        try:
            while True:
                frames = await self._socket.recv_multipart()
                self._heard()
                try:
                    msg = decode(frames)
                except CodecError as e:
                    log.warning("bad_message_from_scheduler", error=str(e))
                    continue
                self._dispatch(msg)
        except (asyncio.CancelledError, zmq.ContextTerminated, zmq.ZMQError):
            pass
        finally:
            for state in self._requests.values():
                state.fail(ClientClosed("the client stopped receiving"))
            self._requests.clear()

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        """Follows the scheduler's connection: up after each handshake, down (and every request in flight
        lost) when it closes."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._heard()
                    self._connected.set()
                    log.info("scheduler_connected", address=self.address)
                elif event == zmq.EVENT_DISCONNECTED:
                    if self._connected.is_set():
                        log.warning("scheduler_disconnected", address=self.address)
                    self._connected.clear()
                    self._fail_all("the scheduler went away; the request was lost")
                else:  # a scheduler that does not hold our key, or no CURVE server at all
                    log.error("scheduler_handshake_failed", address=self.address, event=int(event))
        except (asyncio.CancelledError, zmq.ContextTerminated, zmq.ZMQError):
            pass
        finally:
            monitor.close(linger=0)

    def _heard(self) -> None:
        self._last_heard = time.monotonic()
        self._sent_into_silence = None

    def _owed_for(self, now: float) -> float:
        """Seconds the scheduler has owed an answer without giving any: since the later of its last message,
        the first request sent after it, and the last stall of this process."""
        owed_since = max(self._last_heard, self._sent_into_silence or 0.0, self._rearmed_at)
        return max(0.0, now - owed_since)

    async def _keep_alive(self) -> None:
        """While requests are in flight, makes sure the scheduler still answers: it is asked for info when
        quiet, and its requests fail when it owes an answer for `liveness_timeout_s` (a hung process)."""
        period = min(LIVENESS_PING_S, self._liveness_timeout_s / 4)
        clock = StallClock(period, time.monotonic())
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            stalled = clock.tick(now)
            if stalled:
                # This process was not running: the scheduler's answers may wait unread in the socket. They
                # are read before the next tick, and the scheduler gets a whole timeout from now.
                log.warning("client_stalled", stalled_s=round(stalled, 1), num_requests=len(self._requests))
                self._rearmed_at = now
            if not self._requests or not self._connected.is_set():
                continue
            silent = self._owed_for(now)
            if silent > self._liveness_timeout_s:
                log.error(
                    "scheduler_not_answering", silent_s=round(silent, 1), num_requests=len(self._requests)
                )
                self._fail_all(f"the scheduler did not answer for {silent:.0f} s; the request was lost")
                self._heard()  # the next requests get a full timeout of their own
            elif silent > period or stalled:
                self._send_nowait(InfoRequest(next(self._query_counter)))  # any answer counts

    def _fail_all(self, message: str) -> None:
        """Ends every request in flight with UNAVAILABLE (they are gone at the scheduler, or may be)."""
        requests, self._requests = self._requests, {}
        for request_id, state in requests.items():
            state.fail(RequestRejected(ErrorKind.UNAVAILABLE, message, request_id))
            if self._connected.is_set():  # a hung scheduler that comes back must not run them on
                self._send_nowait(AbortRequest(request_id))

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, RequestOutputs):
            for out in msg.outputs:
                state = self._requests.get(out.request_id)
                if state is None:
                    continue  # finished or aborted here already
                try:
                    abort = state.on_output(out)
                except Exception as e:  # a detokenizer failure must not stop every other request
                    log.exception("output_failed", request_id=out.request_id)
                    self._requests.pop(out.request_id, None)
                    self._send_nowait(AbortRequest(out.request_id))
                    state.fail(RequestRejected(ErrorKind.INTERNAL, f"client failed on output: {e}"))
                    continue
                if abort is not None:
                    self._send_nowait(abort)
                if state.done:
                    del self._requests[out.request_id]
        elif isinstance(msg, RequestError):
            state = self._requests.pop(msg.request_id, None)
            if state is not None:
                state.fail(RequestRejected(msg.kind, msg.message, msg.request_id))
        elif isinstance(msg, (InfoReply, KVSnapshot)):
            waiter = self._info_waiters.pop(msg.query_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        else:
            log.warning("unexpected_message_from_scheduler", type=type(msg).__name__)

    async def close(self) -> None:
        """Aborts the unfinished requests at the scheduler and closes the socket."""
        if self._closed:
            return
        self._closed = True
        if self._socket is None:
            return
        for request_id, state in list(self._requests.items()):
            self._send_nowait(AbortRequest(request_id))
            state.fail(ClientClosed("the client was closed"))
        self._requests.clear()
        await asyncio.sleep(0)  # let the queued aborts reach the socket before it closes
        # Stop the monitor before its reader goes: libzmq's I/O thread would block sending it an event
        # (a disconnect while the socket lingers) with nobody at the other end, and stall the whole context.
        self._socket.disable_monitor()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.close()
