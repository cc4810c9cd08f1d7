"""Telling a silent peer from a process of our own that was not running.

A watch that declares a peer dead after some silence measures that silence on its own clock. When this
process is stopped (SIGSTOP, a debugger), swapped out, starved of CPU, or its event loop is blocked, its
watch does not run either, and the first tick after the resume sees the whole pause as the peer's silence,
although the peer's messages wait, unread, in this process's sockets. A periodic watch therefore checks its
own tick first: one that comes much later than its period means that this process stalled; the watch then
lets the messages that arrived meanwhile be read and starts its timeouts afresh instead of judging.

The price: a watch whose own process stalls for longer than its tolerance at every tick never declares a
silent peer dead by time alone (a peer that exits is still seen at once, by its closed connection).
"""

from __future__ import annotations


class StallClock:
    """The clock of a watch that ticks every `period_s`: says by how much each tick came late."""

    def __init__(self, period_s: float, now: float, tolerance_s: float | None = None) -> None:
        self.period_s = period_s
        # Lateness up to this is the scheduling jitter of a busy machine, not a stall; a false stall only
        # delays a verdict by one timeout, a missed one kills a healthy peer, so the bar is low.
        self.tolerance_s = period_s if tolerance_s is None else tolerance_s
        self._last_tick = now

    def tick(self, now: float) -> float:
        """Seconds for which this process was not running since the last tick (0.0: the tick is on time)."""
        late = now - self._last_tick - self.period_s
        self._last_tick = now
        return late if late > self.tolerance_s else 0.0
