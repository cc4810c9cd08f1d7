"""One replica over two "hosts" on this machine: two `pagedserve serve` invocations in separate sessions,
host 0 (api, scheduler, rank 0) and host 1 (rank 1 alone), TP=2 split 1 + 1, meeting over gloo at
--dist-init-addr. Host 1 is given no cluster key (a path that cannot exist): only rank 0 talks to the
scheduler. What it does not run: NCCL between GPUs of different hosts (no second GPU host here)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.client import EngineClient
from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.common.security import load_cluster_key
from pagedserve.worker.model_runner import ModelRunner
from scripts._servers import free_port
from tests.test_engine_correctness import _run_engine

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ["--device", "cpu", "--dtype", "float32", "--num-kv-blocks", "64", "--max-model-len", "256"]
START_S = 180.0  # two ranks loading and joining on a shared 2-core machine
STOP_S = 90.0


class Node:
    """One `pagedserve serve` host: its launcher in a session of its own, its output in a file."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
        env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pagedserve", "serve", *argv],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]

    def check_alive(self) -> None:
        assert self.proc.poll() is None, self.text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def _health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def _serving(node: Node) -> dict:
    """The launcher's "serving" line: the processes it started."""
    lines = [line for line in node.log.read_text().splitlines() if '"event": "serving"' in line]
    assert len(lines) == 1, node.text()
    return json.loads(lines[0])


@pytest.fixture
def two_hosts(tiny_model_dir: Path, tmp_path: Path) -> Iterator[tuple[Node, Node, str, str, Path]]:
    key0 = tmp_path / "host0" / "cluster_key"
    load_cluster_key(key0)
    no_key = "/proc/no-such-dir/cluster_key"  # host 1's ranks follow rank 0 and never read a key
    port, scheduler = free_port(), f"tcp://127.0.0.1:{free_port()}"
    common = [
        str(tiny_model_dir), *SETTINGS, "--tensor-parallel-size", "2", "--nnodes", "2",
        "--dist-init-addr", f"127.0.0.1:{free_port()}", "--worker-address", f"tcp://127.0.0.1:{free_port()}",
    ]  # fmt: skip
    host0 = Node(
        [*common, "--node-rank", "0", "--cluster-key-file", str(key0), "--port", str(port),
         "--scheduler-address", scheduler],
        tmp_path / "host0.log",
    )  # fmt: skip
    host1 = Node([*common, "--node-rank", "1", "--cluster-key-file", no_key], tmp_path / "host1.log")
    try:
        yield host0, host1, f"http://127.0.0.1:{port}", scheduler, key0
    finally:
        host0.kill()
        host1.kill()


def test_two_hosts_serve_the_single_process_greedy_tokens_and_stop_together(
    tiny_model_dir: Path, two_hosts: tuple[Node, Node, str, str, Path]
) -> None:
    prompts = [[3, 4, 5, 6], list(range(10, 47)), [7] * 20]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    single = ModelRunner(
        WorkerConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    )
    expected, _ = _run_engine(single, prompts, params, max_num_seqs=8, max_num_batched_tokens=256)

    host0, host1, url, scheduler, key = two_hosts
    deadline = time.monotonic() + START_S
    while _health(url) != 200:  # /health: 200 once rank 0 (and so the whole group) is ready
        host0.check_alive()
        host1.check_alive()
        assert time.monotonic() < deadline, host0.text() + host1.text()
        time.sleep(0.5)
    # host 1 runs rank 1 alone, no api and no scheduler of its own
    assert set(_serving(host1)["supervisors"]) == {"worker1"} and '"following_rank_0"' in host1.text()
    assert set(_serving(host0)["supervisors"]) == {"api", "scheduler", "worker"}

    with EngineClient(scheduler, cluster_key_file=str(key)) as client:
        results = client.generate(prompts, params)
    assert [r.outputs[0].token_ids for r in results] == [expected[(i, 0)] for i in range(3)]
    body = json.dumps({"prompt": prompts[1], "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    request = urllib.request.Request(
        url + "/v1/completions", body.encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        assert r.status == 200 and json.load(r)["usage"]["completion_tokens"] == 12

    # A stop to both hosts at once (a LeaderWorkerSet group deleted): host 0 drains and its rank 0 tells
    # rank 1 to stop, so both launchers exit cleanly.
    host0.proc.send_signal(signal.SIGTERM)
    host1.proc.send_signal(signal.SIGTERM)
    assert host0.proc.wait(timeout=STOP_S) == 0, host0.text()
    assert host1.proc.wait(timeout=STOP_S) == 0, host1.text()
    assert '"shutdown"' in host1.text()
