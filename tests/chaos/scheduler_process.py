"""A real scheduler process on 127.0.0.1 (`python -m pagedserve.scheduler`), for tests that signal it or read
its RSS."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scripts._servers import ROOT, free_port


@dataclass
class SchedulerProcess:
    proc: subprocess.Popen
    scheduler_port: int
    worker_port: int
    key_file: Path
    log_file: Path

    @property
    def scheduler_address(self) -> str:
        return f"tcp://127.0.0.1:{self.scheduler_port}"

    @property
    def worker_address(self) -> str:
        return f"tcp://127.0.0.1:{self.worker_port}"

    def rss_bytes(self) -> int:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        [line] = [line for line in status.splitlines() if line.startswith("VmRSS:")]
        return int(line.split()[1]) * 1024

    def logs(self) -> str:
        return self.log_file.read_text(errors="replace")


@contextlib.contextmanager
def scheduler_process(tmp_path: Path, *flags: str) -> Iterator[SchedulerProcess]:
    """Starts the scheduler with `flags`, waits until both its ports listen, and kills it at the end."""
    scheduler_port, worker_port = free_port(), free_port()
    key_file = tmp_path / "cluster_key"
    log_file = tmp_path / "scheduler.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    argv = [
        *("--scheduler-address", f"tcp://127.0.0.1:{scheduler_port}"),
        *("--worker-address", f"tcp://127.0.0.1:{worker_port}"),
        *("--cluster-key-file", str(key_file)),
        *flags,
    ]
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.scheduler", *argv], cwd=ROOT, env=env, stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 60
        for port in (scheduler_port, worker_port):
            while True:
                assert proc.poll() is None, log_file.read_text()
                assert time.monotonic() < deadline, "the scheduler never listened"
                with socket.socket() as probe:
                    if probe.connect_ex(("127.0.0.1", port)) == 0:
                        break
                time.sleep(0.05)
        yield SchedulerProcess(proc, scheduler_port, worker_port, key_file, log_file)
    finally:
        proc.kill()
        proc.wait()
