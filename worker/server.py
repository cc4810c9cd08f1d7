"""The worker process: load the model, announce it to the scheduler, then run every StepPlan it sends.

The scheduler binds a ROUTER socket; the worker connects a DEALER, so each message is just the two frames of
`common.messages.encode` (an empty delimiter frame, if a scheduler sends one, is ignored).
"""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import zmq

from common.config import WorkerConfig
from common.log import configure_logging
from common.messages import CodecError, Shutdown, StepPlan, WorkerReady, decode, encode
from worker.heartbeat import HeartbeatThread
from worker.model_runner import ModelRunner
from worker.parallel import ParallelContext, init_parallel
from worker.step_trace import StepTrace

POLL_MS = 100  # how often the receive loop looks at the stop flag
STEP_POLL_MS = 1  # while a step runs: how often the loop looks whether it is done (a plan wakes it at once)


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop exits at its next poll instead of dying mid-step."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def set(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = signum


def model_name(cfg: WorkerConfig) -> str:
    return cfg.served_model_name or Path(cfg.model).resolve().name


def serve(cfg: WorkerConfig) -> int:
    """Runs the worker until Shutdown or a stop signal; returns the process exit code."""
    log = configure_logging("worker", cfg.log_level)
    started = time.monotonic()
    cfg, parallel = init_parallel(cfg)  # at tensor_parallel_size 1: nothing, no torch.distributed
    if parallel.world_size > 1:
        log = log.bind(rank=parallel.rank, tensor_parallel_size=parallel.world_size)
    log.info(
        "loading_model",
        model=cfg.model,
        device=cfg.resolved_device,
        dtype=cfg.resolved_dtype,
        kv_cache_dtype=cfg.resolved_kv_cache_dtype,
    )
    runner = ModelRunner(cfg, attention_backend=cfg.resolved_attention_backend, parallel=parallel)
    log.info(
        "model_loaded",
        model=str(Path(cfg.model).resolve()),
        device=str(runner.device),
        dtype=str(runner.dtype).removeprefix("torch."),
        attention_backend=cfg.resolved_attention_backend,
        num_kv_blocks=runner.num_kv_blocks,
        num_cpu_blocks=runner.num_cpu_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        torch_threads=torch.get_num_threads(),
        load_time_s=round(time.monotonic() - started, 3),
    )
    if runner.num_kv_blocks * runner.block_size < runner.max_model_len:
        log.warning(
            "kv_pool_smaller_than_one_sequence",
            pool_tokens=runner.num_kv_blocks * runner.block_size,
            max_model_len=runner.max_model_len,
        )
    if not parallel.is_driver:
        code = 1
        try:
            code = _follow(runner, parallel, log)
            return code
        finally:
            runner.close()
            parallel.close(wait_for_others=code == 0)

    # Installed after loading: until then the default handlers end the process at once, which is right.
    stop = _StopFlag()
    signal.signal(signal.SIGTERM, stop.set)
    signal.signal(signal.SIGINT, stop.set)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cfg.worker_address)
    ready = WorkerReady(
        num_kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size,
        eos_token_ids=runner.eos_token_ids,
        model_root=str(Path(cfg.model).resolve()),
        model_name=model_name(cfg),
        num_cpu_blocks=runner.num_cpu_blocks,
        worker_id=uuid.uuid4().hex,
    )
    sock.send_multipart(encode(ready))
    heartbeat = HeartbeatThread(cfg.worker_address, ready.worker_id, cfg.heartbeat_interval_s).start()
    log.info(
        "worker_ready", address=cfg.worker_address, model_name=ready.model_name, worker_id=ready.worker_id
    )
    trace = StepTrace(Path(cfg.step_trace)) if cfg.step_trace else None
    runner.trace_launches = trace is not None
    code = 1
    try:
        code = _loop(sock, runner, stop, log, parallel, trace)
        return code
    finally:
        if trace is not None:
            trace.close()
        runner.close()
        parallel.close(wait_for_others=code == 0)
        heartbeat.stop()
        sock.close()
        ctx.term()


def _next_plan_or_done(sock: zmq.Socket, runner: ModelRunner) -> bool:
    """While a step runs: True as soon as a message waits (the next plan, to be queued behind the step), or
    False once the step is done and nothing waits (then it is answered)."""
    while True:
        if sock.poll(0):
            return True
        if runner.in_flight[0].done():
            return False
        sock.poll(STEP_POLL_MS)


def _answer(sock: zmq.Socket, runner: ModelRunner, trace: StepTrace | None) -> None:
    """Waits for the oldest step in flight and sends its output."""
    if trace is None:
        sock.send_multipart(encode(runner.finish()))
        return
    wait = time.perf_counter()
    out = runner.finish()
    done = time.perf_counter()
    sock.send_multipart(encode(out))
    trace.answered(out, wait, done, time.perf_counter())


def _loop(
    sock: zmq.Socket,
    runner: ModelRunner,
    stop: _StopFlag,
    log: Any,
    parallel: ParallelContext,
    trace: StepTrace | None = None,
) -> int:
    """Receives plans and answers them. A plan that arrives while the previous step still runs is launched
    behind it before that step is answered, so the GPU has the next step queued when it finishes one; the
    new step's sampler is queued after that answer (its forward pass keeps the GPU busy meanwhile)."""
    while stop.signum is None:
        if runner.in_flight:
            if not _next_plan_or_done(sock, runner):
                _answer(sock, runner, trace)
                continue
        elif not sock.poll(POLL_MS):
            parallel.keep_followers_alive()
            continue
        frames = sock.recv_multipart()
        received = time.perf_counter()
        if len(frames) == 3 and frames[0] == b"":
            frames = frames[1:]
        try:
            msg = decode(frames)
        except CodecError as e:
            log.error("bad_message", error=str(e))
            continue
        if isinstance(msg, StepPlan):
            parallel.forward_to_followers(frames)  # every rank runs every step; rank 0 alone answers
            try:
                # The step before it is answered once done, between this step's forward and its sampler:
                # the sampler's host work then overlaps the scheduler's next plan.
                forwarded = runner.launch_forward(msg)
                while len(runner.in_flight) > (0 if forwarded is not None else 1):
                    _answer(sock, runner, trace)
                if forwarded is not None:
                    runner.launch_sampling(forwarded)
                if trace is not None:
                    trace.launched(msg, received, time.perf_counter(), runner.launch_marks)
            except Exception:
                # The worker's state no longer matches the scheduler's: exit loudly rather than guess.
                # Launching msg or finishing the step before it: name every step involved.
                steps_in_flight = [step.step_id for step in runner.in_flight]
                log.exception("step_failed", step_id=msg.step_id, steps_in_flight=steps_in_flight)
                return 1
        elif isinstance(msg, Shutdown):
            parallel.forward_to_followers(frames)
            log.info("shutdown", reason=msg.reason)
            _drain(runner)
            return 0
        else:
            log.error("unexpected_message", type=type(msg).__name__)
    log.info("stopped_by_signal", signal=signal.Signals(stop.signum).name)
    parallel.stop_followers("rank 0 stopped by a signal")
    return 0


def _drain(runner: ModelRunner) -> None:
    """Finishes the steps still in flight (their answers are not wanted any more)."""
    while runner.in_flight:
        runner.finish()


def _follow(runner: ModelRunner, parallel: ParallelContext, log: Any) -> int:
    """A tensor-parallel rank other than 0: runs every StepPlan that rank 0 forwards, in step with it,
    until Shutdown, or until rank 0 goes away."""
    # No stop flag here: a follower blocks inside the group's receive, where it could not look at one, and
    # holds nothing that needs a clean exit. Rank 0 answers the scheduler and tells the others to stop.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    log.info("following_rank_0")
    while True:
        try:
            frames = parallel.receive_message()
        except RuntimeError as e:  # rank 0 exited, or sent nothing within the group timeout
            log.error("lost_rank_0", error=str(e))
            return 1
        if not frames:
            continue  # rank 0's keepalive
        msg = decode(frames)
        if isinstance(msg, StepPlan):
            try:
                runner.launch(msg)  # behind the step before it, as rank 0 does
                while len(runner.in_flight) > 1:
                    runner.finish()
            except Exception:
                # Launching msg or finishing the step before it: name every step involved.
                steps_in_flight = [step.step_id for step in runner.in_flight]
                log.exception("step_failed", step_id=msg.step_id, steps_in_flight=steps_in_flight)
                return 1
        elif isinstance(msg, Shutdown):
            log.info("shutdown", reason=msg.reason)
            _drain(runner)
            return 0
