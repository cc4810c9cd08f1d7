"""A two-rank tensor-parallel worker group through the real processes: the scheduler,
`python -m pagedserve.worker` for each rank (and, under honcho, the whole Procfile with `-c worker=2`), and
a ZeroMQ or HTTP client."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from pagedserve.client import EngineClient
from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from scripts._servers import Engine, Honcho, free_port, start_engine
from tests.engine_loop import run_engine
from tests.test_engine_correctness import _run_engine
from tests.test_speculative_engine import prompts as spec_prompts

pytestmark = pytest.mark.e2e

SETTINGS = {"device": "cpu", "dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}


def _start_group(model_dir: Path, log_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Engine:
    """The scheduler, then worker ranks 0 and 1 (`python -m pagedserve.worker` with PAGEDSERVE_RANK) on one
    worker address."""
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
    stack = Honcho(
        tiny_model_dir, tmp_path / "honcho.log", ("-c", "worker=2"), env={"OMP_NUM_THREADS": "1"},
        **SETTINGS, tensor_parallel_size=2, dist_init_method=f"tcp://127.0.0.1:{free_port()}",
    )  # fmt: skip
    log_path = stack.log_path
    try:
        stack.wait_healthy()
        status, body = stack.post({"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 4
    finally:
        os.killpg(stack.honcho.pid, signal.SIGTERM)
        try:
            stack.honcho.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(stack.honcho.pid, signal.SIGKILL)
            raise
    text = log_path.read_text()
    assert '"rank": 0' in text and '"rank": 1' in text and "following_rank_0" in text


def test_a_stop_signal_to_every_rank_lets_the_stream_finish(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """honcho and supervisors signal every process at once. Rank 1 used to die at once and take rank 0's next
    collective with it; it now follows rank 0 until its Shutdown, so the request in flight completes."""
    engine = _start_group(tiny_model_dir, tmp_path / "logs", monkeypatch)
    try:
        with EngineClient(engine.scheduler_address) as client:
            _wait_ready(client, engine)
            handle = client.submit_one(
                [3, 4, 5], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
            )
            first = next(iter(handle))  # generating
            for name in ("scheduler", "worker", "worker1"):
                engine.procs[name].send_signal(signal.SIGTERM)
            result = handle.result(timeout=60)
            assert len(first.token_ids) + len(result.outputs[0].token_ids) == 120  # result(): the rest
            assert result.outputs[0].finish_reason == "length"
        codes = {name: engine.procs[name].wait(timeout=60) for name in ("scheduler", "worker", "worker1")}
        assert codes == {"scheduler": 0, "worker": 0, "worker1": 0}, engine.logs("worker1")
        assert '"shutdown"' in engine.logs("worker1")
    finally:
        engine.stop()


def _metric(text: str, name: str) -> float:
    """A counter's value in Prometheus text."""
    values = [line.split()[1] for line in text.splitlines() if line.startswith(name + " ")]
    assert len(values) == 1, text
    return float(values[0])


def test_two_worker_ranks_draft_with_a_draft_model_as_one_process_without(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The draft model under tensor parallelism through the real processes: the scheduler server and rank
    1's follower loop, which receives each plan while its own step may still be in flight. With the target
    as its own draft every draft is accepted, and the tokens are one process's without speculation. (The
    followers once launched a plan behind a step whose accepted drafts had moved the positions, giving both
    ranks other tokens: a plan without draft slots after an accepting step, here when the small pool has no
    room for a sequence's draft slots, which never preempt.)"""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    limits = {"max_num_batched_tokens": 48, "max_num_seqs": 8}
    pool = {"num_kv_blocks": 24, "block_size": 4, **limits}
    single = ModelRunner(
        WorkerConfig(model=str(tiny_model_dir), device="cpu", dtype="float32", swap_space=0.05, **pool)
    )
    prompts = spec_prompts(single.vocab_size)[-5:]
    run = run_engine(single, [(p, params) for p in prompts], prefix="", **limits)

    draft = json.dumps({"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 3})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    settings = {**SETTINGS, **pool, "tensor_parallel_size": 2, "speculative_config": draft}
    engine = start_engine(tiny_model_dir, tmp_path / "logs", **settings)
    try:
        with EngineClient(engine.scheduler_address) as client:
            _wait_ready(client, engine)
            results = client.generate(prompts, params)
            assert [r.outputs[0].token_ids for r in results] == [run.tokens[(i, 0)] for i in range(5)]
            metrics = client.info().metrics_text
        drafted = _metric(metrics, "pagedserve_spec_draft_tokens_total")
        assert _metric(metrics, "pagedserve_spec_accepted_tokens_total") == drafted > 0
    finally:
        engine.stop()
