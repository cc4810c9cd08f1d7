"""worker/step_waiter.py: the worker loop's poll wakes when the step it waits for ends, not on a timeout."""

from __future__ import annotations

import threading
import time

import zmq

from pagedserve.worker.step_waiter import StepWaiter


class _Event:
    """Stands in for a recorded torch.cuda.Event: synchronize() blocks until the test ends the step."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1
        self.ended.wait(5.0)


def test_the_poll_wakes_when_the_watched_step_ends():
    ctx = zmq.Context()
    waiter = StepWaiter(ctx)
    try:
        step = _Event()
        waiter.watch(step)
        waiter.watch(step)  # each event is waited for once
        assert waiter.wake.poll(50) == 0  # not before the step ends
        ended_at = time.perf_counter()
        step.ended.set()
        assert waiter.wake.poll(2000) != 0
        assert time.perf_counter() - ended_at < 0.5  # at once, not on a timeout
        waiter.drain()
        assert waiter.wake.poll(0) == 0 and step.waits == 1
        done = _Event()
        done.ended.set()
        waiter.watch(done)  # a step already done wakes it too
        assert waiter.wake.poll(2000) != 0
        waiter.drain()
    finally:
        waiter.close()
        ctx.term()  # (closes: no socket left open)


def test_close_stops_the_thread_and_a_failed_step_still_wakes():
    ctx = zmq.Context()
    waiter = StepWaiter(ctx)

    class Failed:
        def synchronize(self) -> None:
            raise RuntimeError("the device failed")

    waiter.watch(Failed())
    assert waiter.wake.poll(2000) != 0  # the loop looks, and finds the failure when it finishes the step
    waiter.close()
    assert not waiter._thread.is_alive()
    ctx.term()
