"""`python -m pagedserve.common.supervisor MODULE [ARGS...]`: runs `python -m MODULE ARGS` and restarts it
when it exits (named in its logs as MODULE without the `pagedserve.` prefix: `pagedserve.api` is "api").

Each entry of the Procfile runs under one, because honcho stops every process as soon as one exits: with a
supervisor in between, a process that dies (killed, crashed, told to stop by a scheduler that declared it
dead) comes back while the others stay up, and the others find it again by themselves (the worker announces
itself to a restarted scheduler; the api's client reconnects).

Restart policy:
- any exit is followed by a restart, after a pause that starts at `MIN_BACKOFF_S` and doubles with each
  quick failure up to `MAX_BACKOFF_S`; a process that ran `STABLE_S` or longer starts over at the minimum;
- except exit code 2, a usage or configuration error (a bad flag, an unusable cluster key): restarting would
  fail the same way, so the supervisor exits with it (and honcho then stops the rest, which is the point);
- SIGTERM or SIGINT to the supervisor is passed to the process as SIGTERM (in a terminal the process gets
  the Ctrl-C itself too: one press must not count as two, common/interrupts.py), which drains and exits
  (its own `--shutdown-timeout-s`); the supervisor then exits with the process's code and restarts nothing;
- a second SIGINT (a second Ctrl-C) during the drain kills the process and exits at once (status 130).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from types import FrameType

from pagedserve.common.interrupts import FORCED_EXIT
from pagedserve.common.log import configure_logging

MIN_BACKOFF_S = 0.5
MAX_BACKOFF_S = 15.0
STABLE_S = 60.0  # a run this long counts as healthy: the next failure restarts after the minimum pause
USAGE_ERROR = 2  # argparse's code, and the processes' own for an unusable configuration


class Supervisor:
    """Keeps one child process running; see the module docstring for the policy."""

    def __init__(self, argv: list[str], name: str) -> None:
        self.argv = argv
        self.name = name
        self.log = configure_logging("supervisor").bind(child=name)
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping: int | None = None  # the signal that asked us to stop
        self.interrupts = 0  # SIGINTs received: the second forces the exit
        self.restarts = 0

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.interrupts += signum == signal.SIGINT
        forced = self.interrupts >= 2
        first = self.stopping is None
        self.stopping = self.stopping or signum
        if self.child is not None and self.child.poll() is None and (first or forced):
            self.child.send_signal(signal.SIGKILL if forced else signal.SIGTERM)

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        backoff = MIN_BACKOFF_S
        while True:
            started = time.monotonic()
            self.child = subprocess.Popen(self.argv)
            if self.stopping is not None:  # the stop came while it was being started: pass it on now
                self.child.send_signal(signal.SIGKILL if self.interrupts >= 2 else signal.SIGTERM)
            self.log.info("started", pid=self.child.pid, restarts=self.restarts)
            code = self._wait()
            ran_s = time.monotonic() - started
            if self.interrupts >= 2:
                self.log.warning("forced_exit", exit_code=code, reason="interrupted twice")
                return FORCED_EXIT
            if self.stopping is not None:
                self.log.info("stopped", exit_code=code)
                return 0 if code in (0, -signal.SIGTERM) else code
            if code == USAGE_ERROR:
                self.log.error("not_restarted", exit_code=code, reason="a usage or configuration error")
                return code
            backoff = MIN_BACKOFF_S if ran_s >= STABLE_S else backoff
            self.log.warning("exited", exit_code=code, ran_s=round(ran_s, 1), restart_in_s=backoff)
            if self._sleep(backoff):
                return 0
            backoff = min(2 * backoff, MAX_BACKOFF_S)
            self.restarts += 1

    def _wait(self) -> int:
        assert self.child is not None
        while True:
            try:
                return self.child.wait()
            except InterruptedError:  # a signal arrived mid-wait; the handler has passed it on
                continue

    def _sleep(self, seconds: float) -> bool:
        """Sleeps `seconds` unless asked to stop meanwhile; returns whether it was."""
        deadline = time.monotonic() + seconds
        while self.stopping is None and time.monotonic() < deadline:
            time.sleep(min(0.05, deadline - time.monotonic()))
        return self.stopping is not None


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0].startswith("-"):
        print(
            "usage: python -m pagedserve.common.supervisor MODULE [ARGS...]  (runs python -m MODULE ARGS)",
            file=sys.stderr,
        )
        return USAGE_ERROR
    return Supervisor([sys.executable, "-m", *args], args[0].removeprefix("pagedserve.")).run()


if __name__ == "__main__":
    sys.exit(main())
