"""common.supervisor's restart policy, on a stand-in process: restarts with a growing pause, no restart of a
configuration error, SIGTERM passed on and the child's clean exit reported as 0, a second Ctrl-C (SIGINT)
ending a drain that would not end.

Defect guarded: under `scripts/start`, any one process exiting stopped all three, and nothing restarted them.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from scripts._servers import ROOT

FLAKY = """
import os, signal, sys, time
runs = os.path.join(os.path.dirname(__file__), "runs")
with open(runs, "a") as f:
    f.write(f"{time.monotonic()}\\n")
count = len(open(runs).read().split())
code = int(sys.argv[1])
if count < 3 or code == 2:
    sys.exit(code)
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a clean drain
while True:
    time.sleep(0.05)
"""


def _supervise(tmp_path: Path, code: int) -> subprocess.Popen:
    (tmp_path / "flaky.py").write_text(FLAKY)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    return subprocess.Popen(
        [sys.executable, "-m", "pagedserve.common.supervisor", "flaky", str(code)], cwd=ROOT, env=env
    )


def _runs(tmp_path: Path) -> list[float]:
    path = tmp_path / "runs"
    return [float(t) for t in path.read_text().split()] if path.exists() else []


def test_a_process_that_exits_is_restarted_with_growing_pauses_and_stops_cleanly(tmp_path):
    supervisor = _supervise(tmp_path, code=1)
    try:
        deadline = time.monotonic() + 30
        while len(_runs(tmp_path)) < 3:
            assert time.monotonic() < deadline and supervisor.poll() is None
            time.sleep(0.05)
        time.sleep(0.3)  # the third run stays up; the supervisor waits on it
        assert supervisor.poll() is None
        starts = _runs(tmp_path)
        pauses = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        assert pauses[0] >= 0.5 and pauses[1] >= 1.0, pauses  # 0.5 s, then doubled
        supervisor.send_signal(signal.SIGTERM)
        assert supervisor.wait(timeout=10) == 0
        assert len(_runs(tmp_path)) == 3  # stopping restarts nothing
    finally:
        supervisor.kill()


def test_a_configuration_error_is_not_restarted(tmp_path):
    supervisor = _supervise(tmp_path, code=2)
    try:
        assert supervisor.wait(timeout=30) == 2
        assert len(_runs(tmp_path)) == 1
    finally:
        supervisor.kill()


# A process whose drain never ends: it notes each signal it gets, and keeps running
STUCK = """
import os, signal, sys, time
got = os.path.join(os.path.dirname(__file__), "got")
def note(signum, _frame):
    with open(got, "a") as f:
        f.write(signal.Signals(signum).name + "\\n")
signal.signal(signal.SIGTERM, note)
signal.signal(signal.SIGINT, note)
open(got, "a").close()
while True:
    time.sleep(0.05)
"""


def test_a_second_sigint_kills_a_draining_process_and_exits_at_once(tmp_path):
    """A second Ctrl-C did not force the exit: the supervisor waited on the drain (issue 36, item 7)."""
    (tmp_path / "stuck.py").write_text(STUCK)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}:{ROOT}"}
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.common.supervisor", "stuck"], cwd=ROOT, env=env
    )
    got = tmp_path / "got"
    try:
        deadline = time.monotonic() + 60
        while not got.exists():
            assert time.monotonic() < deadline and supervisor.poll() is None
            time.sleep(0.05)
        supervisor.send_signal(signal.SIGINT)
        while "SIGTERM" not in got.read_text():  # passed on as SIGTERM: one Ctrl-C never counts twice
            assert time.monotonic() < deadline and supervisor.poll() is None
            time.sleep(0.05)
        time.sleep(0.5)
        assert supervisor.poll() is None  # the drain goes on
        supervisor.send_signal(signal.SIGINT)
        assert supervisor.wait(timeout=60) == 130
        assert got.read_text().split() == ["SIGTERM"]  # then killed, not asked again
    finally:
        supervisor.kill()
