"""The worker process: load the model, announce it to the scheduler, then run every StepPlan it sends.

The scheduler binds a ROUTER socket; the worker connects a DEALER (a CURVE client holding the cluster key,
common/security.py), so each message is just the two frames of `common.messages.encode` (an empty delimiter
frame, if a scheduler sends one, is ignored).

The worker announces itself (WorkerReady) each time its connection to the scheduler is made. When that
connection closes (the scheduler exited), the steps in flight are finished and every sequence forgotten, and
the worker announces itself afresh to the scheduler that comes back on the same address. A plan that does
not match the worker's state (ModelRunner.check_plan) is not run: the worker forgets everything and announces
itself again, which makes the scheduler fail what ran and start over with an empty cache.

A Shutdown with `reannounce` (the scheduler declared this worker dead for its silence: it was stopped, or
starved) is no exit: the worker forgets everything and announces itself again, so a process that continues
after a pause serves again at once instead of being restarted.

SIGTERM does not stop the worker at once: it serves for `shutdown_timeout_s` more, while the scheduler lets
its requests finish, and exits when the scheduler says Shutdown or goes away. Tensor-parallel ranks other
than 0 keep following rank 0 through that time and exit on its Shutdown.
"""

from __future__ import annotations

import signal
import sys
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from pagedserve.common.config import WorkerConfig
from pagedserve.common.interrupts import Interrupts
from pagedserve.common.log import configure_logging
from pagedserve.common.messages import CodecError, Shutdown, StepPlan, WorkerReady, decode, encode
from pagedserve.common.model_source import ModelSourceError, resolve_config
from pagedserve.common.monitor import open_monitor
from pagedserve.common.security import ClusterKey, ClusterKeyError, load_cluster_key, secure_client
from pagedserve.common.socket_limits import Receiver, WireLimits, max_message_bytes
from pagedserve.worker.heartbeat import HeartbeatThread
from pagedserve.worker.kv_window import freeing_window
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.parallel import ParallelContext, init_parallel
from pagedserve.worker.step_trace import StepTrace
from pagedserve.worker.step_waiter import StepWaiter
from pagedserve.worker.steps import verifies_drafts

POLL_MS = 100  # how often the receive loop looks at the stop flag
STEP_POLL_MS = 5  # while a step runs: the longest the loop sleeps (a plan, or the step's end, wakes it)
SHUTDOWN_GRACE_S = 5.0  # after SIGTERM, beyond shutdown_timeout_s: time for the scheduler's Shutdown to come


class _StopFlag:
    """Set by SIGTERM/SIGINT: the loop serves until the scheduler's Shutdown, the scheduler's going away, or
    `grace_s` after the first signal, never dying mid-step. Later signals change nothing (under a supervisor
    and honcho the same stop arrives twice), but a second SIGINT (Ctrl-C), which exits at once."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.signum: int | None = None
        self.deadline = float("inf")  # monotonic time after which the loop exits
        self.interrupts = Interrupts("worker")

    def set(self, signum: int, _frame: FrameType | None) -> None:
        self.interrupts.note(signum)
        if self.signum is None:
            self.signum = signum
            self.deadline = time.monotonic() + self.grace_s

    def due(self) -> bool:
        return time.monotonic() > self.deadline


class _Connection:
    """The DEALER socket to the scheduler and what its monitor says about it."""

    def __init__(self, address: str, key: ClusterKey, limits: WireLimits) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        secure_client(self.sock, key, max_message_bytes(Receiver.WORKER, limits))
        self.monitor = open_monitor(
            self.sock,
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_FAILED_AUTH,
        )
        self.sock.connect(address)
        self.waiter = StepWaiter(self.ctx)  # wakes the poll when the step in flight ends
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.waiter.wake, zmq.POLLIN)
        self.up = False  # a scheduler is connected
        self.ever_up = False

    def events(self) -> list[int]:
        """The connection events since the last call (never waits)."""
        events = []
        while self.monitor.poll(0):
            events.append(int(parse_monitor_message(self.monitor.recv_multipart())["event"]))
        return events

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close()
        self.waiter.close()
        self.sock.close()
        self.ctx.term()


def model_name(cfg: WorkerConfig) -> str:
    return cfg.served_model_name or Path(cfg.model).resolve().name


def _gib(num_bytes: int | None) -> float | None:
    return None if num_bytes is None else round(num_bytes / (1 << 30), 3)


def memory_usage(runner: ModelRunner) -> dict[str, Any]:
    """Where this rank's memory went, in GiB: weights, the activations' peak (the CUDA profile's peak less the
    weights; None where nothing was profiled: the CPU, or a fixed --num-kv-blocks), the KV pool (with its
    blocks and tokens), the CPU swap pool, and the CUDA graphs (None without graphs)."""
    tensors = [*runner.model.parameters(), *runner.model.buffers()]
    weights = sum(t.numel() * t.element_size() for t in tensors)
    pool = runner.kv.device_pool
    peak = runner.profile_peak_bytes
    return {
        "weights_gib": _gib(weights),
        "activations_peak_gib": _gib(None if peak is None else peak - weights),
        "kv_pool_gib": _gib(pool.numel() * pool.element_size()),
        "kv_blocks": runner.num_kv_blocks,
        "kv_tokens": runner.num_kv_blocks * runner.block_size,
        "swap_pool_gib": _gib(
            runner.num_cpu_blocks and runner.kv.cpu_pool.numel() * runner.kv.cpu_pool.element_size()
        ),
        "cuda_graphs_gib": _gib(runner.graph_bytes),
    }


GIL_SWITCH_INTERVAL_S = 2e-4


def serve(cfg: WorkerConfig) -> int:
    """Runs the worker until Shutdown or a stop signal; returns the process exit code."""
    log = configure_logging("worker", cfg.log_level)
    started = time.monotonic()
    # The main thread launches the GPU's work; a background thread (masks filled ahead, swaps) that holds the
    # GIL in Python makes it wait for the switch interval, 5 ms by default, a whole decode step.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    try:  # a config made in code: a Hub repo id becomes its snapshot here (parse_config did it otherwise)
        cfg = resolve_config(cfg)
    except ModelSourceError as e:
        log.error("model_not_found", error=str(e))
        return 2
    # at tensor_parallel_size 1: nothing, no torch.distributed
    cfg, parallel = init_parallel(cfg, load_model_config(cfg.model))
    if parallel.world_size > 1:
        log = log.bind(rank=parallel.rank, tensor_parallel_size=parallel.world_size)
    log.info(
        "loading_model",
        model=cfg.model,
        device=cfg.resolved_device,
        dtype=cfg.resolved_dtype,
        kv_cache_dtype=cfg.resolved_kv_cache_dtype,
        load_format=cfg.load_format,
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
    log.info("memory", device=str(runner.device), **memory_usage(runner))
    if runner.num_kv_blocks * runner.block_size < runner.max_model_len:
        log.warning(
            "kv_pool_smaller_than_one_sequence",
            pool_tokens=runner.num_kv_blocks * runner.block_size,
            max_model_len=runner.max_model_len,
        )
    if not parallel.is_driver:
        code = 1
        # A stop signal reaches every rank at once (honcho, a supervisor, a terminal's ^C), while rank 0
        # serves on for shutdown_timeout_s to let streams finish, which needs every rank in each step's
        # collectives: a follower waits for rank 0's Shutdown, giving up only after rank 0's own deadline.
        stop = _StopFlag(cfg.shutdown_timeout_s + 2 * SHUTDOWN_GRACE_S)
        signal.signal(signal.SIGTERM, stop.set)
        signal.signal(signal.SIGINT, stop.set)
        try:
            code = _follow(runner, parallel, log, stop)
            return code
        finally:
            runner.close()
            parallel.close(wait_for_others=code == 0)

    try:
        key = load_cluster_key(cfg.cluster_key_file)
    except ClusterKeyError as e:
        log.error("cluster_key_unusable", error=str(e))
        return 2
    # Installed after loading: until then the default handlers end the process at once, which is right.
    stop = _StopFlag(cfg.shutdown_timeout_s + SHUTDOWN_GRACE_S)
    signal.signal(signal.SIGTERM, stop.set)
    signal.signal(signal.SIGINT, stop.set)
    # the scheduler batches within the limits the worker announces: they bound its plans
    limits = WireLimits(runner.max_model_len, runner.max_num_seqs, block_size=runner.block_size)
    conn = _Connection(cfg.worker_address, key, limits)
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
        max_num_seqs=runner.max_num_seqs,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        num_speculative_tokens=runner.num_speculative_tokens,
        sliding_window=freeing_window(runner.model_config, runner.spec),
        num_host_tier_blocks=runner.kv.num_host_tier_blocks,
        num_disk_tier_blocks=runner.kv.num_disk_tier_blocks,
        tier_block_bytes=runner.kv.tier_block_bytes,
    )
    heartbeat = HeartbeatThread(cfg.worker_address, ready.worker_id, cfg.heartbeat_interval_s, key).start()
    log.info(
        "worker_ready", address=cfg.worker_address, model_name=ready.model_name, worker_id=ready.worker_id
    )
    trace = StepTrace(Path(cfg.step_trace)) if cfg.step_trace else None
    runner.trace_launches = trace is not None
    code = 1
    try:
        code = _loop(conn, ready, runner, stop, log, parallel, trace)
        return code
    finally:
        if trace is not None:
            trace.close()
        runner.close()
        parallel.close(wait_for_others=code == 0)
        heartbeat.stop()
        conn.close()


def _next_plan_or_done(conn: _Connection, runner: ModelRunner) -> bool:
    """While a step runs: True as soon as a message waits (the next plan, to be queued behind the step), or
    False once the step is done and nothing waits (then it is answered). The step's end wakes the poll
    (worker/step_waiter.py); the timeout only bounds a missed wake-up."""
    while True:
        if conn.sock.poll(0):
            return True
        step = runner.in_flight[0]
        if step.done():
            return False
        conn.waiter.watch(step.ended)
        conn.poller.poll(STEP_POLL_MS)
        conn.waiter.drain()


def _answer(sock: zmq.Socket, runner: ModelRunner, trace: StepTrace | None) -> None:
    """Waits for the oldest step in flight and sends its output."""
    if trace is None:
        sock.send_multipart(encode(runner.finish()))
        return
    wait = time.perf_counter()
    out = runner.finish()
    done = time.perf_counter()
    sock.send_multipart(encode(out))
    trace.answered(out, wait, done, time.perf_counter(), runner.launch_trace.take(out.step_id))


def _loop(
    conn: _Connection,
    ready: WorkerReady,
    runner: ModelRunner,
    stop: _StopFlag,
    log: Any,
    parallel: ParallelContext,
    trace: StepTrace | None = None,
) -> int:
    """Receives plans and answers them. A plan that arrives while the previous step still runs is launched
    behind it before that step is answered, so the GPU has the next step queued when it finishes one; the
    new step's sampler is queued after that answer (its forward pass keeps the GPU busy meanwhile)."""
    sock = conn.sock
    while not stop.due():
        for event in conn.events():
            _on_connection_event(event, conn, ready, runner, log, parallel)
        if stop.signum is not None and not conn.up:
            break  # stopping, and no scheduler to drain for
        if runner.in_flight:
            if not _next_plan_or_done(conn, runner):
                _answer(sock, runner, trace)
                if not runner.in_flight and not sock.poll(0):
                    runner.draft_ahead()  # while the scheduler plans the next step (worker/spec/ahead.py)
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
            try:
                problem = runner.check_plan(msg)
            except Exception as e:  # a bug in the check itself: the plan is not run either way
                log.exception("plan_check_failed", step_id=msg.step_id)
                problem = f"the check failed: {e}"
            if problem is not None:
                # The scheduler's view of this worker and the worker's own differ: start both over.
                log.error("bad_plan", step_id=msg.step_id, problem=problem)
                _reannounce(conn, ready, runner, log, parallel, "a plan did not match the worker's state")
                continue
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
                    trace.drafted(msg.step_id, runner.spec.ahead.stats if runner.spec else None)
            except Exception:
                # The device's state is unknown after a failed step: exit loudly; the supervisor restarts.
                # Launching msg or finishing the step before it: name every step involved.
                steps_in_flight = [step.step_id for step in runner.in_flight]
                log.exception("step_failed", step_id=msg.step_id, steps_in_flight=steps_in_flight)
                return 1
        elif isinstance(msg, Shutdown) and msg.reannounce:
            _reannounce(conn, ready, runner, log, parallel, f"the scheduler said: {msg.reason}")
        elif isinstance(msg, Shutdown):
            parallel.forward_to_followers(frames)
            log.info("shutdown", reason=msg.reason)
            _drain(runner)
            return 0
        else:
            log.error("unexpected_message", type=type(msg).__name__)
    if stop.signum is not None:
        log.info("stopped_by_signal", signal=signal.Signals(stop.signum).name)
    parallel.stop_followers("rank 0 stopped")
    return 0


def _on_connection_event(
    event: int,
    conn: _Connection,
    ready: WorkerReady,
    runner: ModelRunner,
    log: Any,
    parallel: ParallelContext,
) -> None:
    if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        conn.up = True
        if conn.ever_up:  # a scheduler that came back (or a new one) knows nothing of what this one holds
            _reannounce(conn, ready, runner, log, parallel, "the scheduler's connection was made again")
        else:
            conn.sock.send_multipart(encode(ready))
        conn.ever_up = True
    elif event == zmq.EVENT_DISCONNECTED:
        conn.up = False
        log.warning("scheduler_disconnected", steps_in_flight=len(runner.in_flight))
    else:
        log.error("scheduler_refused_the_cluster_key", event=event)


def _reannounce(
    conn: _Connection, ready: WorkerReady, runner: ModelRunner, log: Any, parallel: ParallelContext, why: str
) -> None:
    """Forgets every sequence (after the steps in flight), drops the plans of the scheduler it served, and
    announces itself again: the scheduler then starts over with an empty cache. The other ranks get the
    announcement too, and reset with it."""
    log.warning("reannouncing", reason=why, steps_in_flight=len(runner.in_flight))
    runner.reset()  # (it finishes the steps in flight first)
    while conn.sock.poll(0):
        conn.sock.recv_multipart()  # plans of the scheduler's old core
    frames = encode(ready)
    parallel.forward_to_followers(frames)
    conn.sock.send_multipart(frames)


def _drain(runner: ModelRunner) -> None:
    """Finishes the steps still in flight (their answers are not wanted any more)."""
    while runner.in_flight:
        runner.finish()


def _follow(runner: ModelRunner, parallel: ParallelContext, log: Any, stop: _StopFlag | None = None) -> int:
    """A tensor-parallel rank other than 0: runs every StepPlan that rank 0 forwards, in step with it,
    until Shutdown, until rank 0 goes away, or past `stop`'s deadline after a stop signal (the receive
    returns at least every keepalive, so the deadline is looked at)."""
    stop = stop or _StopFlag(float("inf"))
    log.info("following_rank_0")
    while True:
        if stop.due():
            log.warning("stopped_by_signal_without_shutdown", signal=signal.Signals(stop.signum or 15).name)
            return 1
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
                # As on rank 0, whose scheduler waits for these answers: a plan that drafts waits for the
                # tokens in flight (drafts read them on the host), and a step that verifies drafts finishes
                # before the next plan is applied (the drafts it accepts move the positions).
                while runner.in_flight and (msg.draft_slots or verifies_drafts(runner.in_flight)):
                    runner.finish()
                runner.launch(msg)  # behind the step before it, as rank 0 does
                while len(runner.in_flight) > 1:
                    runner.finish()
            except Exception:
                # Launching msg or finishing the step before it: name every step involved.
                steps_in_flight = [step.step_id for step in runner.in_flight]
                log.exception("step_failed", step_id=msg.step_id, steps_in_flight=steps_in_flight)
                return 1
        elif isinstance(msg, WorkerReady):  # rank 0 announced itself again: forget every sequence
            runner.reset()
        elif isinstance(msg, Shutdown):
            log.info("shutdown", reason=msg.reason)
            _drain(runner)
            return 0
