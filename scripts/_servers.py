"""Starts the server's processes (scheduler and worker, and the api when asked) on free 127.0.0.1 ports,
for benchmark scripts and the end-to-end tests (tests/e2e/processes.py); or the README's whole stack, honcho
on the Procfile (`Honcho`), for the tests and scripts that run it as an operator would.

    engine = start_engine(Path("models/tiny-llama"), log_dir, device="cpu", kv_policy="reserved")
    try:
        ...  # AsyncEngineClient(engine.scheduler_address); wait until InfoReply.ready
    finally:
        engine.stop()
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WAIT_S = 60.0  # bound on a Honcho wait: a missed recovery fails, it never hangs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Engine:
    """A running scheduler + worker pair; `scheduler_address` is where clients connect."""

    scheduler_address: str
    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)  # every process's environment, PAGEDSERVE_* settings
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    root: Path = ROOT  # the checkout whose code runs (another worktree: a comparison of two commits)

    def start(self, name: str, rank: int = 0) -> subprocess.Popen:
        """Starts `python -m NAME` (again, after it exited: tests restart a worker), logging to KEY.log, where
        KEY (its key in `procs`) is NAME, or NAME followed by the rank for a worker rank other than 0."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        key = f"{name}{rank}" if rank else name
        mode = "ab" if key in self.procs else "wb"  # a restart keeps the log of the process it replaces
        env = self.env | {"PAGEDSERVE_RANK": str(rank)} if rank else self.env
        with open(self.log_dir / f"{key}.log", mode) as log:  # the child holds its own copy of the fd
            self.procs[key] = subprocess.Popen(
                [sys.executable, "-m", f"pagedserve.{name}"],
                cwd=self.root,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return self.procs[key]

    def logs(self, name: str, tail: int = 3000) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-tail:]

    def check_alive(self) -> None:
        """Raises RuntimeError, with the process's log tail, when one of them has exited."""
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.logs(name)}")

    def stop(self, timeout: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_engine(
    model_dir: Path,
    log_dir: Path,
    processes: tuple[str, ...] = ("scheduler", "worker"),
    root: Path = ROOT,
    **settings: object,
) -> Engine:
    """Starts `python -m NAME` for each of `processes` with PAGEDSERVE_* settings (e.g. num_kv_blocks=64),
    from the checkout at `root` (this one by default).
    With `tensor_parallel_size=N`, "worker" starts N ranks (procs "worker", "worker1", ...) that meet at a
    free 127.0.0.1 port.

    Returns at once; the caller waits for InfoReply.ready or /health (and calls `check_alive` meanwhile).
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env.update(
        PAGEDSERVE_MODEL=str(model_dir),
        PAGEDSERVE_SCHEDULER_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
        PAGEDSERVE_WORKER_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
        PYTHONUNBUFFERED="1",
    )
    env.update({"PAGEDSERVE_" + k.upper(): str(v) for k, v in settings.items() if v is not None})
    num_ranks = int(settings.get("tensor_parallel_size", 1))  # type: ignore[call-overload]
    if num_ranks > 1:
        env["PAGEDSERVE_DIST_INIT_METHOD"] = f"tcp://127.0.0.1:{free_port()}"
    engine = Engine(env["PAGEDSERVE_SCHEDULER_ADDRESS"], log_dir, env, root=Path(root))
    for name in processes:
        for rank in range(num_ranks if name == "worker" else 1):
            engine.start(name, rank)
    return engine


# `honcho` with its KILL_WAIT (seconds from its SIGTERM to its SIGKILL, fixed at 5) set to argv[1]
HONCHO_WITH_KILL_WAIT = (
    "import sys, honcho.manager; honcho.manager.KILL_WAIT = float(sys.argv.pop(1)); "
    "from honcho.command import main; main()"
)


class Honcho:
    """`honcho start [ARGS]` on the Procfile in its own session, configured through PAGEDSERVE_* variables
    (`settings`, plus `env` as given), on free 127.0.0.1 ports, logging to `log_path`. Returns at once.
    `kill_wait_s`: how long honcho lets its processes stop before it kills them (honcho's own 5 s if None)."""

    def __init__(
        self,
        model_dir: Path,
        log_path: Path,
        honcho_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        kill_wait_s: float | None = None,
        **settings: object,
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.scheduler_address = f"tcp://127.0.0.1:{free_port()}"
        bin_dir = Path(sys.executable).parent
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
        full_env.update(
            PATH=f"{bin_dir}:{full_env.get('PATH', '')}",
            PAGEDSERVE_MODEL=str(model_dir),
            PAGEDSERVE_PORT=str(self.port),
            PAGEDSERVE_SCHEDULER_ADDRESS=self.scheduler_address,
            PAGEDSERVE_WORKER_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
            PAGEDSERVE_DEVICE="cpu",
            PYTHONUNBUFFERED="1",
        )
        full_env.update({"PAGEDSERVE_" + k.upper(): str(v) for k, v in settings.items()})
        full_env.update(env or {})
        self.env = full_env
        self.log_path = log_path
        self.kill_wait_s = 5.0 if kill_wait_s is None else kill_wait_s
        honcho = [str(bin_dir / "honcho")]
        if kill_wait_s is not None:
            honcho = [sys.executable, "-c", HONCHO_WITH_KILL_WAIT, str(kill_wait_s)]
        with open(log_path, "wb") as log:
            self.honcho = subprocess.Popen(
                [*honcho, "start", *honcho_args], cwd=ROOT, env=full_env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def get(self, path: str, timeout: float = 2.0) -> int:
        """The HTTP status of GET `path` (0 while nothing listens)."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def post(self, body: dict, path: str = "/v1/completions", timeout: float = WAIT_S) -> tuple[int, dict]:
        """The status and JSON answer of POST `path` with `body`."""
        req = urllib.request.Request(
            self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def wait_until(
        self, what: str, check: Callable[[], bool], timeout: float = WAIT_S, period: float = 0.05
    ) -> float:
        """Polls `check()` until true; returns the monotonic time it first was. Raises when honcho exits or
        `timeout` passes, with the log's tail."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.honcho.poll() is not None:
                raise AssertionError(f"honcho exited while waiting for {what}:\n{self.logs()[-4000:]}")
            if check():
                return time.monotonic()
            time.sleep(period)
        raise TimeoutError(f"{what} did not happen within {timeout} s:\n{self.logs()[-4000:]}")

    def wait_healthy(self, timeout: float = 120.0) -> float:
        return self.wait_until("/health 200", lambda: self.get("/health") == 200, timeout, 0.3)

    def stop(self, timeout: float = 20.0) -> int:
        """SIGTERM to honcho (it passes it on); SIGKILL to the whole session past `timeout`."""
        if self.honcho.poll() is None:
            self.honcho.send_signal(signal.SIGTERM)
        try:
            return self.honcho.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.honcho.pid, signal.SIGKILL)
            return self.honcho.wait()
