"""Starts the real api, scheduler and worker processes on free 127.0.0.1 ports, for end-to-end tests."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from scripts._servers import ROOT, Engine, free_port, start_engine

__all__ = ["ROOT", "Server", "free_port", "start_server"]


@dataclass
class Server:
    """A running api + scheduler + worker trio. `url` is the HTTP base, `scheduler_address` the ZeroMQ one."""

    url: str
    engine: Engine

    @property
    def scheduler_address(self) -> str:
        return self.engine.scheduler_address

    @property
    def procs(self) -> dict[str, subprocess.Popen]:
        return self.engine.procs

    def logs(self, name: str) -> str:
        return self.engine.logs(name, tail=1 << 30)

    def stop(self) -> None:
        self.engine.stop()

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


def start_server(model_dir: Path, log_dir: Path, timeout: float = 120.0, **settings: object) -> Server:
    """Starts the three processes with PAGEDSERVE_* settings (e.g. num_kv_blocks=64) and waits for /health."""
    port = free_port()
    engine = start_engine(
        model_dir,
        log_dir,
        ("scheduler", "worker", "api"),
        port=port,
        host="127.0.0.1",
        device="cpu",
        **settings,
    )
    server = Server(f"http://127.0.0.1:{port}", engine)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            engine.check_alive()
        except RuntimeError:
            server.stop()
            raise
        try:
            if server.get("/health", timeout=2)[0] == 200:
                return server
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    server.stop()
    tails = "\n".join(engine.logs(name) for name in engine.procs)
    raise TimeoutError("the server did not become healthy:\n" + tails)
