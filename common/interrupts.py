"""A second Ctrl-C forces the exit: the first SIGINT (or SIGTERM) drains a process, which may take its
`--shutdown-timeout-s`; a second SIGINT ends it at once, as an operator who presses Ctrl-C again expects.

Only SIGINT counts: SIGTERM can arrive twice for one stop (honcho signals a process group that holds both a
supervisor and its process, and the supervisor passes the stop on), while a SIGINT comes from a person. The
supervisor (common/supervisor.py) passes a SIGINT on as SIGTERM for that reason: in a terminal, its
process gets Ctrl-C itself too, and one press must not count twice.
"""

from __future__ import annotations

import os
import signal
import sys

FORCED_EXIT = 128 + signal.SIGINT  # the shell's status for a process ended by Ctrl-C
FIRST_NOTICE = "interrupted: stopping once requests in flight end (Ctrl-C again to exit now)"


class Interrupts:
    """Counts a process's SIGINTs (its signal handlers call `note`); at the second, ends it at once."""

    def __init__(self, process: str) -> None:
        self.process = process
        self.count = 0

    def note(self, signum: int) -> None:
        if signum != signal.SIGINT:
            return
        self.count += 1
        if self.count == 1:  # for the person at the terminal, who may not want to wait for the drain
            print(f"{self.process}: {FIRST_NOTICE}", file=sys.stderr, flush=True)
        if self.count >= 2:
            # os._exit: no drain, no cleanup that could itself wait (an event loop's, a thread's join)
            print(f"{self.process}: interrupted twice: exiting now", file=sys.stderr, flush=True)
            os._exit(FORCED_EXIT)


def ignore_further_stops() -> None:
    """For a process that is stopping: a later SIGTERM changes nothing. Under honcho one arrives whenever
    another process exits first (honcho then signals every group), and one arriving while Python shuts
    down would kill the process, its status 0 turned into -15: Python puts back the default action of
    each signal it handles as it exits, but leaves an ignored one ignored."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
