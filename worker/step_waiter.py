"""Wakes the worker loop the moment the step it waits for is done on the device.

While a step runs and no plan waits, the loop (worker/server.py) sleeps in a poll of the scheduler's socket
and looks whether the step is done when the poll times out: with a 1 ms timeout it saw a finished step 0.5
ms late on average. That lag is the GPU's idle time wherever the next plan needs this step's answer (a
drafting step at low load: the scheduler plans nothing until it knows the accepted drafts,
scheduler/speculation.py). A thread blocks on the step's end event instead (the GIL released) and sends a
byte on an inproc socket that the loop polls beside the scheduler's, so the poll returns as soon as the
step ends, or a plan comes.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any

import zmq

_ids = itertools.count()


class StepWaiter:
    """One thread that waits for the end events of the steps it is told to watch, and wakes `wake`."""

    def __init__(self, context: zmq.Context) -> None:
        address = f"inproc://pagedserve-step-waiter-{next(_ids)}"
        self.wake = context.socket(zmq.PAIR)  # polled (and drained) by the loop's thread only
        self.wake.setsockopt(zmq.LINGER, 0)
        self.wake.bind(address)
        self._send = context.socket(zmq.PAIR)  # used by the waiting thread only
        self._send.setsockopt(zmq.LINGER, 0)
        self._send.connect(address)
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._watched: Any = None  # the end event last handed to the thread
        self._thread = threading.Thread(target=self._run, name="step-waiter", daemon=True)
        self._thread.start()

    def watch(self, ended: Any) -> None:
        """Wakes `wake` once `ended` (a recorded torch.cuda.Event) has completed; each event once."""
        if ended is not None and ended is not self._watched:
            self._watched = ended
            self._events.put(ended)

    def drain(self) -> None:
        """Takes the wake-ups that came (each only says: look again)."""
        while self.wake.poll(0):
            self.wake.recv()

    def _run(self) -> None:
        while True:
            ended = self._events.get()
            if ended is None:
                return
            try:
                ended.synchronize()
            except Exception:  # (a failed step: the loop finds out itself when it finishes the step)
                pass
            try:
                self._send.send(b"", zmq.NOBLOCK)
            except zmq.ZMQError:  # closed, or the loop has not drained a wake-up: one is enough
                pass

    def close(self) -> None:
        """Stops the thread (after the event it waits for, if any) and closes the sockets."""
        self._events.put(None)
        self._thread.join(timeout=5.0)
        self._send.close()
        self.wake.close()
