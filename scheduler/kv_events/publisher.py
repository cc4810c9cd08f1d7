"""The ZeroMQ side: a PUB socket that sends each step's batch, and a ROUTER socket that resends the
buffered ones a subscriber missed. Both live on one thread of their own, so the scheduler's step never
waits on a socket: `publish` only puts the batch in a bounded queue (a full queue drops it, counted).

Wire (vLLM's, `vllm/distributed/kv_events.py`):
- PUB: three frames per batch: topic, sequence number (8 bytes big-endian, 0, 1, 2, ...), payload
  (scheduler/kv_events/wire.py). At `hwm` queued messages a slow subscriber loses batches; the gap in the
  sequence numbers tells it to ask for a replay.
- ROUTER (replay): a request is [empty frame, starting sequence number (8 bytes big-endian)] from a
  DEALER (a ROUTER sees the sender's identity first); the answer is one message per buffered batch from
  that number on (the last `buffer_steps`), in the live messages' three frames [topic, seq, payload], then
  [empty, -1 (8 bytes, signed), empty]. (vLLM's documented contract; with the default empty
  topic this is also what older vLLM sends.)
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Protocol

import structlog
import zmq

from pagedserve.common.kv_events_config import KVEventsConfig, endpoint_for_rank
from pagedserve.scheduler.kv_events.wire import EventBatch, encode_batch

log = structlog.get_logger(process="scheduler")
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # closes a replay answer
_POLL_S = 0.05  # how long the thread waits for a batch before it looks at replay requests again


class EventPublisher(Protocol):
    published: int  # batches handed to the socket
    dropped: int  # batches lost because the queue was full

    def publish(self, batch: EventBatch) -> None: ...

    def close(self) -> None: ...


class NullEventPublisher:
    """`"publisher": "null"`: batches are counted and dropped."""

    def __init__(self) -> None:
        self.published = 0
        self.dropped = 0

    def publish(self, batch: EventBatch) -> None:
        self.published += 1

    def close(self) -> None:
        pass


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds `endpoint` (else it connects to a subscriber that binds): vLLM's rule
    (a wildcard host, an IPv6 address, ipc://, inproc://), a loopback host (our default) and 0.0.0.0."""
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    local = host in ("localhost", "[::1]", "0.0.0.0") or host.startswith("127.")
    return "*" in endpoint or "::" in endpoint or not endpoint.startswith("tcp://") or local


class ZmqEventPublisher:
    """Publishes batches on a thread of its own, keeping the last `buffer_steps` for replay."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        self.endpoint = endpoint_for_rank(config.endpoint, data_parallel_rank)
        self.replay_endpoint = (
            endpoint_for_rank(config.replay_endpoint, data_parallel_rank) if config.replay_endpoint else None
        )
        self.data_parallel_rank = data_parallel_rank
        self.published = 0
        self._queue_dropped = 0  # written by `publish` (the scheduler's thread) only
        self._send_dropped = 0  # written by the publisher's thread only
        self._topic = config.topic.encode()
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.MAXMSGSIZE, 4096)  # a subscriber sends only (un)subscriptions to a topic
        self._replay: zmq.Socket | None = None
        try:
            (self._pub.bind if binds(self.endpoint) else self._pub.connect)(self.endpoint)
            if self.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.setsockopt(zmq.MAXMSGSIZE, 64)  # requests are 8 bytes: larger drops the peer
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        # The sockets are used by the thread only from here on (ZeroMQ sockets are not thread-safe).
        self._thread = threading.Thread(target=self._run, name="kv-events-publisher", daemon=True)
        self._thread.start()
        log.info("kv_events_publishing", endpoint=self.endpoint, replay_endpoint=self.replay_endpoint)

    def publish(self, batch: EventBatch) -> None:
        """Queues the batch for the thread; never blocks (a full queue drops it, counted in `dropped`)."""
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self.data_parallel_rank
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._queue_dropped += 1
            if self._queue_dropped & (self._queue_dropped - 1) == 0:  # 1, 2, 4, 8, ...: a bounded log
                log.warning("kv_events_dropped", dropped=self._queue_dropped, reason="the queue is full")

    @property
    def dropped(self) -> int:
        """Batches lost: the queue was full, or the socket refused them."""
        return self._queue_dropped + self._send_dropped

    def close(self, timeout_s: float = 1.0) -> None:
        """Sends what is queued (for up to `timeout_s`), then closes the sockets."""
        deadline = time.monotonic() + timeout_s
        while self._thread.is_alive() and time.monotonic() < deadline:
            try:
                self._queue.put(None, timeout=0.05)
                break
            except queue.Full:
                continue
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # ----------------------------------------------------------------------------------------------------
    # the thread

    def _run(self) -> None:
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                self._send(batch)
            except Exception:  # a bug must not end publishing for good
                log.exception("kv_events_send_failed")

    def _send(self, batch: EventBatch) -> None:
        payload = encode_batch(batch)
        seq = self._next_seq
        self._next_seq += 1
        self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
            self.published += 1
        except zmq.Again:  # (a PUB socket drops at its HWM rather than refuse; connected, it may refuse)
            self._send_dropped += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart(zmq.NOBLOCK)
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("kv_events_bad_replay_request", num_frames=len(frames))  # dropped, not answered
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart(
                    (identity, self._topic, seq.to_bytes(8, "big"), payload), zmq.NOBLOCK
                )
        self._replay.send_multipart((identity, b"", END_SEQ, b""), zmq.NOBLOCK)
