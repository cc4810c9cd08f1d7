"""A two-rank tensor-parallel worker group through the real processes: the scheduler, `python -m worker` for
each rank (and, under honcho, the whole Procfile with `-c worker=2`), and a ZeroMQ or HTTP client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from common.client import EngineClient
from common.config import WorkerConfig
from common.messages import SamplingParams
from scripts._servers import ROOT, Engine, free_port, start_engine
from tests.test_engine_correctness import _run_engine
from worker.model_runner import ModelRunner

pytestmark = pytest.mark.e2e

SETTINGS = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}


def _start_group(model_dir: Path, log_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """The scheduler, then worker ranks 0 and 1 (`python -m worker` with PAGEDSERVE_RANK) on one worker
    address."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on this machine's cores
    return start_engine(model_dir, log_dir, tensor_parallel_size=2, **SETTINGS)


def _wait_ready(client: EngineClient, engine: Engine, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        engine.check_alive()
        try:
            if client.info(timeout=2.0).ready:
                return
        except TimeoutError:
            pass
        assert time.monotonic() < deadline, engine.logs("worker") + engine.logs("worker1")
        time.sleep(0.2)


def test_two_worker_ranks_serve_the_single_process_tokens(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[3, 4, 5, 6], list(range(10, 47)), [7] * 20]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    single = ModelRunner(
        WorkerConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", num_kv_blocks=64)
    )
    expected, _ = _run_engine(single, prompts, params, max_num_seqs=8, max_num_batched_tokens=256)

    engine = _start_group(tiny_model_dir, tmp_path / "logs", monkeypatch)
    try:
        with EngineClient(engine.scheduler_address) as client:
            _wait_ready(client, engine)
            assert client.info().num_kv_blocks == 64
            results = client.generate(prompts, params)
            assert [r.outputs[0].token_ids for r in results] == [expected[(i, 0)] for i in range(3)]
        assert '"following_rank_0"' in engine.logs("worker1")

        # Rank 0 gone: the other rank notices at once, rather than waiting for a plan forever.
        engine.procs["worker"].kill()
        assert engine.procs["worker1"].wait(timeout=30) == 1
        assert "lost_rank_0" in engine.logs("worker1")
    finally:
        engine.stop()


def test_honcho_with_two_workers_derives_their_ranks(tiny_model_dir: Path, tmp_path: Path) -> None:
    port = free_port()
    bin_dir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env.update({"PAGEDSERVE_" + k.upper(): str(v) for k, v in SETTINGS.items()})
    env.update(
        PATH=f"{bin_dir}:{env.get('PATH', '')}",
        PAGEDSERVE_MODEL=str(tiny_model_dir),
        PAGEDSERVE_PORT=str(port),
        PAGEDSERVE_SCHEDULER_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
        PAGEDSERVE_WORKER_ADDRESS=f"tcp://127.0.0.1:{free_port()}",
        PAGEDSERVE_TENSOR_PARALLEL_SIZE="2",
        PAGEDSERVE_DIST_INIT_METHOD=f"tcp://127.0.0.1:{free_port()}",
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    log_path = tmp_path / "honcho.log"
    with open(log_path, "wb") as log:
        honcho = subprocess.Popen(
            [str(bin_dir / "honcho"), "start", "-c", "worker=2"], cwd=ROOT, env=env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert honcho.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
        body = json.dumps({"prompt": "Hello", "max_tokens": 4, "ignore_eos": True}).encode()
        req = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert json.loads(r.read())["usage"]["completion_tokens"] == 4
    finally:
        os.killpg(honcho.pid, signal.SIGTERM)
        try:
            honcho.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(honcho.pid, signal.SIGKILL)
            raise
    text = log_path.read_text()
    assert '"rank": 0' in text and '"rank": 1' in text and "following_rank_0" in text
