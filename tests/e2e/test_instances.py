"""Servers side by side on one host: each `pagedserve serve` meets its own processes only, and an api that
reaches another instance's scheduler refuses it clearly.

Defect guarded (issue 36, against 2a5cb69): every `pagedserve serve` took ZeroMQ ports 5570/5571, so a second
instance's api joined the first one's scheduler (and reported a misleading "misconfigured" model) while its
own scheduler crash-looped on "Address already in use".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from scripts._servers import ROOT, free_port

pytestmark = pytest.mark.e2e

WAIT_S = 240.0  # a bound for a loaded 2-core machine, never an expectation


def request(url: str, body: dict | None = None) -> tuple[int, dict]:
    """GET `url`, or POST `body` as JSON; the status and the JSON answer (0, {} while nothing listens)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return 0, {}


def wait_for(what: str, check: Callable[[], bool], procs: list[subprocess.Popen], logs: list[Path]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        alive, in_time = all(p.poll() is None for p in procs), time.monotonic() < deadline
        if not (alive and in_time):
            tails = "\n".join(p.read_text(errors="replace")[-3000:] for p in logs)
            raise AssertionError(f"{'exited' if not alive else 'timed out'} waiting for {what}:\n{tails}")
        time.sleep(0.3)


def base_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    return env | {"PYTHONPATH": str(ROOT), "PAGEDSERVE_CLUSTER_KEY_FILE": str(tmp_path / "cluster_key")}


@pytest.fixture(scope="module")
def two_servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[dict]]:
    """Two `pagedserve serve` of the tiny model, started together with nothing but their own HTTP ports."""
    tmp = tmp_path_factory.mktemp("instances")
    env = base_env(tmp) | {"XDG_RUNTIME_DIR": str(tmp)}  # where each makes its instance directory
    servers = []
    for i in range(2):
        port, log = free_port(), tmp / f"serve{i}.log"
        argv = ["-m", "pagedserve", "serve", str(tiny_model_dir), "--port", str(port), "--device", "cpu",
                "--num-kv-blocks", "24", "--shutdown-timeout-s", "2"]  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, *argv], cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        servers.append({"url": f"http://127.0.0.1:{port}", "proc": proc, "log": log, "tmp": tmp})
    try:
        yield servers
    finally:
        for s in servers:
            if s["proc"].poll() is None:
                os.killpg(s["proc"].pid, signal.SIGKILL)
                s["proc"].wait()


def test_two_servers_side_by_side_both_serve_and_clean_up(two_servers: list[dict]) -> None:
    procs, logs = [s["proc"] for s in two_servers], [s["log"] for s in two_servers]
    for s in two_servers:
        wait_for(f"{s['url']}/health 200", lambda s=s: request(s["url"] + "/health")[0] == 200, procs, logs)
    dirs = sorted(p for p in two_servers[0]["tmp"].iterdir() if p.name.startswith("pagedserve-"))
    assert len(dirs) == 2 and all(p.stat().st_mode & 0o077 == 0 for p in dirs)  # one each, private
    for s in two_servers:
        status, body = request(
            s["url"] + "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
        )
        assert status == 200 and body["usage"]["completion_tokens"] == 3, body
    for s in two_servers:
        s["proc"].send_signal(signal.SIGTERM)
    for s in two_servers:
        assert s["proc"].wait(60) == 0, s["log"].read_text()[-4000:]
        assert "Address already in use" not in s["log"].read_text()
    assert not any(p.exists() for p in dirs)  # removed at exit


def test_an_api_refuses_the_scheduler_of_another_instance(tmp_path: Path) -> None:
    address = f"ipc://{tmp_path}/scheduler.sock"
    port = free_port()
    env = base_env(tmp_path) | {"PAGEDSERVE_SCHEDULER_ADDRESS": address}
    logs = [tmp_path / "scheduler.log", tmp_path / "api.log"]
    procs = []
    for (name, instance), log in zip([("scheduler", "first"), ("api", "second")], logs, strict=True):
        settings = {"PAGEDSERVE_INSTANCE_ID": instance, "PAGEDSERVE_PORT": str(port),
                    "PAGEDSERVE_WORKER_ADDRESS": f"ipc://{tmp_path}/worker.sock"}  # fmt: skip
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", name],
                cwd=ROOT,
                env=env | settings,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        procs.append(proc)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for("/health 503", lambda: request(url + "/health")[0] == 503, procs, logs)
        for _ in range(3):
            status, body = request(url + "/health")
            assert status == 503 and body["status"] == "misconfigured", body
            assert "belongs to another pagedserve instance (first; this api's is second)" in body["reason"]
        status, body = request(url + "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert status == 503 and "another pagedserve instance" in body["error"]["message"], body
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
    api_log = logs[1].read_text()
    assert api_log.count('"event": "scheduler_of_another_instance"') == 1, api_log[
        -3000:
    ]  # once, not per probe
