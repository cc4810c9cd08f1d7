"""Starts the real api, scheduler and worker processes on free 127.0.0.1 ports, for end-to-end tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running api + scheduler + worker trio. `url` is the HTTP base, `scheduler_address` the ZeroMQ one."""

    url: str
    scheduler_address: str
    log_dir: Path
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    def logs(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metric(self, name: str) -> float:
        _, text = self.get("/metrics")
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def wait_until_idle(self, timeout: float = 20.0) -> None:
        """Waits until no request runs and every KV block is free again; fails with the metrics otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            used = self.metric("pagedserve_kv_blocks_used")
            if used == 0 and self.metric("pagedserve_requests_running") == 0:
                return
            time.sleep(0.1)
        raise AssertionError("KV blocks still in use: " + self.get("/metrics")[1])

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def start_server(model_dir: Path, log_dir: Path, timeout: float = 120.0, **settings: object) -> Server:
    """Starts the three processes with PAGEDSERVE_* settings (e.g. num_kv_blocks=64) and waits for /health."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env.update(
        PAGEDSERVE_MODEL=str(model_dir),
        PAGEDSERVE_PORT=str(port),
        PAGEDSERVE_HOST="127.0.0.1",
        PAGEDSERVE_SCHEDULER_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
        PAGEDSERVE_WORKER_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
        PAGEDSERVE_DEVICE="cpu",
        PYTHONUNBUFFERED="1",
    )
    env.update({"PAGEDSERVE_" + k.upper(): str(v) for k, v in settings.items()})
    server = Server(f"http://127.0.0.1:{port}", env["PAGEDSERVE_SCHEDULER_ADDRESS"], log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    for name in ("scheduler", "worker", "api"):
        log = open(log_dir / f"{name}.log", "wb")  # noqa: SIM115 (the process owns it)
        server.procs[name] = subprocess.Popen(
            [sys.executable, "-m", name], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, proc in server.procs.items():
            if proc.poll() is not None:
                server.stop()
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{server.logs(name)[-3000:]}")
        try:
            if server.get("/health", timeout=2)[0] == 200:
                return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    server.stop()
    raise TimeoutError(
        "the server did not become healthy:\n" + "\n".join(server.logs(n)[-2000:] for n in server.procs)
    )
