"""The worker's heartbeat: a daemon thread that tells the scheduler every few seconds that this process lives.

It beats from a thread of its own, with its own ZeroMQ context and DEALER socket (sockets are not thread
safe), so it keeps beating while the main thread runs a long step (torch releases the GIL in its kernels).
A process that dies or is stopped goes silent, and the scheduler declares it dead after
`SchedulerConfig.heartbeat_timeout_s`; a main thread stuck inside a step is caught by the step timeout.
"""

from __future__ import annotations

import threading

import zmq

from pagedserve.common.messages import Heartbeat, encode
from pagedserve.common.security import ClusterKey, secure_client
from pagedserve.common.socket_limits import Receiver, max_message_bytes


class HeartbeatThread:
    """Sends `Heartbeat(worker_id)` to `address` every `interval_s` seconds between `start()` and `stop()`."""

    def __init__(self, address: str, worker_id: str, interval_s: float, key: ClusterKey) -> None:
        if interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be positive, got {interval_s}")
        self.address = address
        self.key = key
        self.worker_id = worker_id
        self.interval_s = interval_s
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="worker-heartbeat", daemon=True)

    def start(self) -> HeartbeatThread:
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """Stops beating and waits for the thread to close its socket."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue nothing while the scheduler is away: a beat only means something when it is fresh.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 1)
        secure_client(sock, self.key, max_message_bytes(Receiver.HEARTBEAT))
        sock.connect(self.address)
        frames = encode(Heartbeat(self.worker_id))
        try:
            while True:
                try:
                    sock.send_multipart(frames, flags=zmq.NOBLOCK)
                except zmq.Again:
                    pass  # not connected (yet, or any more): the next beat tries again
                if self._stopped.wait(self.interval_s):
                    return
        finally:
            sock.close()
            ctx.term()
