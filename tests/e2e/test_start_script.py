"""`scripts/start` takes the server's flags, and a second Ctrl-C ends a drain at once, in the launcher and in
each process.

Defects guarded (issue 36, against 2a5cb69): `scripts/start --port N` served on 8000 (honcho took `--port`
as its own) and `--help` showed honcho's help; a second Ctrl-C during the drain changed nothing (the
processes waited out `--shutdown-timeout-s`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.common.interrupts import FIRST_NOTICE
from scripts._servers import ROOT, free_port
from tests.e2e.processes import start_server

pytestmark = pytest.mark.e2e

WAIT_S = 240.0  # a bound for a loaded 2-core machine, never an expectation
LONG_DRAIN_S = "3600"  # a drain that would outlast any test: only a forced exit ends it in time
# seconds of decoding on the CPU; 125 blocks of 16 tokens, within the pools below
LONG_STREAM = {"prompt": "Once", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def stream_in_background(url: str) -> list[bytes]:
    """Starts a long streamed completion in a thread; the list fills with its chunks as they arrive."""
    chunks: list[bytes] = []
    body = json.dumps(LONG_STREAM).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})

    def read() -> None:
        try:
            with urllib.request.urlopen(req, timeout=WAIT_S) as r:
                for line in r:
                    chunks.append(line)
        except OSError:
            pass  # the server was killed under it: the point of the test

    threading.Thread(target=read, daemon=True).start()
    return chunks


def wait_for(what: str, check: Callable[[], bool], log: Callable[[], str]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not check():
        assert time.monotonic() < deadline, f"no {what} in {WAIT_S} s:\n{log()[-4000:]}"
        time.sleep(0.2)


def test_scripts_start_help_lists_the_servers_flags() -> None:
    done = subprocess.run(
        [str(ROOT / "scripts" / "start"), "--help"], capture_output=True, text=True, timeout=WAIT_S
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: pagedserve serve")
    for flag in ("--port", "--host", "--max-model-len", "--tensor-parallel-size", "--scheduler-address"):
        assert flag in done.stdout
    assert "honcho" not in done.stdout.lower()


def test_scripts_start_stops_a_bad_setting_with_one_line_and_status_2(tiny_model_dir: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    done = subprocess.run(
        [str(ROOT / "scripts" / "start"), "--port", "99999"], capture_output=True, text=True, timeout=WAIT_S,
        env=env | {"PAGEDSERVE_MODEL": str(tiny_model_dir)},
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (
        "pagedserve serve: error: --port: bad setting: port must be a TCP port (1-65535), got 99999"
    )


def test_scripts_start_serves_on_its_port_and_a_second_ctrl_c_ends_the_drain(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env |= {"PAGEDSERVE_MODEL": str(tiny_model_dir), "PAGEDSERVE_CLUSTER_KEY_FILE": str(tmp_path / "key")}
    log_path = tmp_path / "start.log"
    argv = [str(ROOT / "scripts" / "start"), "--port", str(port), "--device", "cpu", "--num-kv-blocks", "128",
            "--shutdown-timeout-s", LONG_DRAIN_S]  # fmt: skip
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    logs = log_path.read_text
    try:
        wait_for(f"/health 200 on :{port}", lambda: health(url) == 200 or proc.poll() is not None, logs)
        assert proc.poll() is None, logs()[-4000:]
        chunks = stream_in_background(url)
        wait_for("the stream's first tokens", lambda: len(chunks) >= 4, logs)
        proc.send_signal(signal.SIGINT)
        wait_for("the drain", lambda: health(url) == 503, logs)  # "shutting down"; the stream goes on
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        assert proc.wait(WAIT_S) == 130, logs()[-4000:]
        assert '"event": "forced_exit"' in logs()
        assert health(url) == 0  # nothing listens any more
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_each_process_ends_its_drain_at_a_second_sigint(tiny_model_dir: Path, tmp_path: Path) -> None:
    """The api, the scheduler and the worker run on (draining) after one SIGINT while a stream is in flight,
    and exit at once (status 130) at the second."""
    server = start_server(tiny_model_dir, tmp_path, num_kv_blocks=128, shutdown_timeout_s=LONG_DRAIN_S)
    try:
        chunks = stream_in_background(server.url)
        wait_for("the stream's first tokens", lambda: len(chunks) >= 4, lambda: server.logs("api"))
        for proc in server.procs.values():
            proc.send_signal(signal.SIGINT)
        for name in server.procs:  # each took the first (two signals at once may arrive as one)
            wait_for(f"{name}'s notice", lambda name=name: FIRST_NOTICE in server.logs(name), lambda: "")
        assert server.get("/health")[0] == 503  # the api drains
        assert all(proc.poll() is None for proc in server.procs.values())  # so does each process
        for proc in server.procs.values():
            proc.send_signal(signal.SIGINT)
        for name, proc in server.procs.items():
            assert proc.wait(WAIT_S) == 130, server.logs(name)[-3000:]
            assert "interrupted twice: exiting now" in server.logs(name)
    finally:
        server.stop()
