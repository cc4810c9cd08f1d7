"""Runs the server's processes as `scripts/start` does under honcho, without honcho: each under its own
`python -m pagedserve.common.supervisor MODULE` (restarts with backoff; exit status 2, a usage or
configuration error, is not restarted), and the launcher stops them all when one supervisor exits, as
honcho does.

SIGTERM or SIGINT (Ctrl-C) to the launcher goes to every supervisor once, which passes it on: the api and
the scheduler drain (`--shutdown-timeout-s`), the scheduler then tells the worker to stop. Tensor-parallel
ranks other than 0 are signalled only once rank 0's supervisor has exited: a follower has no stop flag (rank
0 tells it to stop, worker/server.py), so signalled with the others it would die while rank 0 still sends it
the last plans. A process group still alive `GRACE_S` after the drain is killed, and every one at once on a
second Ctrl-C (SIGINT) during the drain. Each supervisor runs in its own session, so a terminal's Ctrl-C
reaches the processes once, through the launcher; on Linux each also gets SIGTERM should the launcher die.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from types import FrameType

import pagedserve
from pagedserve.common.interrupts import FORCED_EXIT
from pagedserve.common.log import configure_logging

GRACE_S = 15.0  # beyond the drain: the worker's own grace and a process's exit
POLL_S = 0.1


@dataclass
class Child:
    """One supervised process: its name in the logs, its module (`python -m MODULE`) and extra variables."""

    name: str
    module: str
    env: dict[str, str] = field(default_factory=dict)
    after: str = ""  # on stop, signalled once this child (by name) has exited: a follower rank after rank 0


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies (Linux's PR_SET_PDEATHSIG; best effort)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def child_env(base: dict[str, str], settings: dict[str, str]) -> dict[str, str]:
    """The processes' environment: `base` without its PAGEDSERVE_* variables (`settings` holds every value),
    with the server's packages found first, wherever the command runs from."""
    env = {k: v for k, v in base.items() if not k.startswith("PAGEDSERVE_")} | settings
    if pagedserve.CODE_ROOT == pagedserve.IMPORT_ROOT:  # a checkout: its root holds the pagedserve folder
        env["PYTHONPATH"] = os.pathsep.join(
            [str(pagedserve.IMPORT_ROOT), *filter(None, [base.get("PYTHONPATH")])]
        )
    env["PYTHONSAFEPATH"] = "1"  # the working directory's own `pagedserve/` must not come first
    env["PYTHONUNBUFFERED"] = "1"
    return env


def preflight(module: str, settings: dict[str, str], timeout_s: float = 600.0) -> str:
    """Runs `python -m MODULE` (a process's checks alone: pagedserve.worker.preflight) with the processes'
    `settings`; returns "" when it passes, else its last line (one line, without the process's prefix)."""
    done = subprocess.run(
        [sys.executable, "-m", module],
        env=child_env(dict(os.environ), settings),
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    if done.returncode == 0:
        return ""
    last = (done.stderr.strip().splitlines() or [""])[-1]
    if done.returncode == 2:  # a configuration error: its one line says which flag
        return last.split("error: ", 1)[-1]
    return f"{module} failed (exit status {done.returncode}): {last}"  # it could not even run its checks


class Launcher:
    """Starts `children` with `settings` (PAGEDSERVE_* variables) and stops them together."""

    def __init__(
        self, children: list[Child], settings: dict[str, str], stop_timeout_s: float, log_level: str = "info"
    ) -> None:
        self.children = children
        self.env = child_env(dict(os.environ), settings)
        self.stop_timeout_s = stop_timeout_s + GRACE_S
        self.log = configure_logging("pagedserve", log_level)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.stopping: int | None = None
        self.interrupts = 0  # SIGINTs received: the second kills everything at once

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        self.stopping = self.stopping or signum
        self.interrupts += signum == signal.SIGINT

    def run(self, **about: str) -> int:
        """Runs until a stop signal or a supervisor's exit; returns the exit status."""
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        for child in self.children:
            self.procs[child.name] = subprocess.Popen(
                [sys.executable, "-m", "pagedserve.common.supervisor", child.module],
                env=self.env | child.env,
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        self.log.info("serving", supervisors={n: p.pid for n, p in self.procs.items()}, **about)
        code = 0
        while self.stopping is None:
            exited = [(name, p.returncode) for name, p in self.procs.items() if p.poll() is not None]
            if exited:  # as honcho: one supervisor gone (a usage error, or stopped from outside) stops all
                name, code = exited[0]
                self.log.error("process_exited", child=name, exit_code=code, action="stopping the others")
                code = code or 1
                break
            time.sleep(POLL_S)
        signum = self.stopping or signal.SIGTERM
        self.log.info("stopping", signal=signal.Signals(signum).name, timeout_s=self.stop_timeout_s)
        codes = self._stop_all(signum)
        if self.interrupts >= 2:
            code = FORCED_EXIT
        elif code == 0:
            code = next((c for c in codes.values() if c not in (0, -signum)), 0)
        self.log.info("stopped", exit_codes=codes)
        return code

    def _stop_all(self, signum: int) -> dict[str, int]:
        """Signals each child once its `after` child has exited, waits for all; kills what is left by the
        deadline. Returns their exit codes."""
        deadline = time.monotonic() + self.stop_timeout_s
        waiting = list(self.children)  # not yet signalled
        while time.monotonic() < deadline and self.interrupts < 2:
            for child in list(waiting):
                leader = self.procs.get(child.after)
                if leader is None or leader.poll() is not None:
                    waiting.remove(child)
                    if self.procs[child.name].poll() is None:
                        self.procs[child.name].send_signal(signum)
            if not waiting and all(p.poll() is not None for p in self.procs.values()):
                break
            time.sleep(POLL_S)
        forced = self.interrupts >= 2
        if forced:
            self.log.warning("forced_exit", reason="interrupted twice")
        for name, proc in self.procs.items():
            if proc.poll() is None:
                if not forced:
                    self.log.error("killed", child=name, after_s=self.stop_timeout_s)
                os.killpg(proc.pid, signal.SIGKILL)  # the supervisor and its process: their own session
                proc.wait()
        return {name: proc.returncode for name, proc in self.procs.items()}
