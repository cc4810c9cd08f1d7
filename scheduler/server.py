"""The scheduler process: ZeroMQ sockets and an asyncio loop around the synchronous `Scheduler` core.

Two ROUTER sockets: clients (the api, ZeroMQ users) connect to `scheduler_address`, workers to
`worker_address`. One task reads each socket; the engine loop runs steps while there is work: schedule,
send the plan, wait for the worker's sampled tokens, update, stream the new tokens to their clients.
With `async_scheduling` (the default) the loop keeps two plans at the worker: it sends plan N+1 before it
waits for step N's tokens, so the worker starts step N+1 as soon as step N is done, and the scheduler's
own work (update, schedule, the codec, streaming) happens while the GPU runs. Client messages are handled
while steps are in flight; the core tolerates that (a sequence aborted mid-step just ignores its late
token, and its blocks are reused only by a later plan, which the worker runs after the ones before it).

A watchdog declares the worker dead when nothing (heartbeat, step output) came from it for
`heartbeat_timeout_s`, or when a step went unanswered for `step_timeout_s`: its requests fail with
UNAVAILABLE, the core goes with all its requests and KV bookkeeping, and new requests are refused until a
worker announces itself again. A worker that re-announces itself is treated the same way, then accepted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import defaultdict
from dataclasses import dataclass

import structlog
import zmq
import zmq.asyncio

from common.config import SchedulerConfig
from common.messages import (
    AbortRequest,
    CodecError,
    ErrorKind,
    Heartbeat,
    InfoReply,
    InfoRequest,
    Message,
    RequestError,
    RequestOutputs,
    SeqOutput,
    Shutdown,
    StepOutput,
    SubmitRequest,
    WorkerReady,
    decode,
    encode,
)
from scheduler.scheduler import Output, Scheduler, SchedulerSettings

log = structlog.get_logger(process="scheduler")


@dataclass
class WorkerWatch:
    """When the worker was last heard from and since when a step waits for it: decides when it is dead.

    Plain bookkeeping on the caller's clock, so that the rules are testable without sockets or sleeps.
    """

    heartbeat_timeout_s: float  # silence (no heartbeat, no step output) that counts as death
    step_timeout_s: float  # a step unanswered this long counts as a hung worker (group)
    last_heard: float  # the last heartbeat, step output or announcement
    step_sent_at: float | None = None  # since when the oldest unanswered step runs; None between steps
    steps_in_flight: int = 0

    def heard(self, now: float) -> None:
        self.last_heard = now

    def step_sent(self, now: float) -> None:
        if self.steps_in_flight == 0:
            self.step_sent_at = now
        self.steps_in_flight += 1

    def step_answered(self, now: float) -> None:
        """The oldest step in flight answered: the next one (the worker runs them in order) starts now."""
        self.steps_in_flight = max(0, self.steps_in_flight - 1)
        self.step_sent_at = now if self.steps_in_flight else None
        self.last_heard = now

    def death_reason(self, now: float) -> str | None:
        """Why the worker counts as dead at `now`, or None while it does not."""
        silent = now - self.last_heard
        if silent > self.heartbeat_timeout_s:
            return f"the worker stopped responding (nothing heard from it for {silent:.1f} s)"
        if self.step_sent_at is not None and now - self.step_sent_at > self.step_timeout_s:
            return f"the worker did not finish a step within {self.step_timeout_s:g} s"
        return None


class SchedulerServer:
    """Serves clients and drives the worker until cancelled."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.core: Scheduler | None = None  # exists while a worker that announced itself is alive
        self.ready_msg: WorkerReady | None = None
        self._ctx = zmq.asyncio.Context()
        self._clients = self._ctx.socket(zmq.ROUTER)
        self._workers = self._ctx.socket(zmq.ROUTER)
        for sock in (self._clients, self._workers):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished client must not block the loop
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._worker_id: bytes | None = None  # the ZeroMQ identity that plans go to
        self._watch: WorkerWatch | None = None  # exists while a worker is accepted
        # step id -> its output's future, for the plans at the worker (one, or two with async scheduling)
        self._pending_steps: dict[int, asyncio.Future[StepOutput]] = {}
        self._wake = asyncio.Event()

    async def run(self) -> None:
        self._clients.bind(self.config.scheduler_address)
        self._workers.bind(self.config.worker_address)
        log.info(
            "scheduler_listening",
            scheduler_address=self.config.scheduler_address,
            worker_address=self.config.worker_address,
        )
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._serve_clients())
                tasks.create_task(self._serve_workers())
                tasks.create_task(self._engine_loop())
                tasks.create_task(self._watchdog())
        finally:
            self._clients.close()
            self._workers.close()
            self._ctx.term()

    # ----------------------------------------------------------------------------------------------------
    # clients

    async def _serve_clients(self) -> None:
        while True:
            identity, *frames = await self._clients.recv_multipart()
            try:
                msg = decode(frames)
            except CodecError as e:
                log.warning("bad_client_message", error=str(e))
                continue
            self._handle_client(identity, msg)

    def _handle_client(self, owner: bytes, msg: Message) -> None:
        if isinstance(msg, SubmitRequest):
            if self.core is None:
                self._send_client(
                    owner, RequestError(msg.request_id, ErrorKind.UNAVAILABLE, "no worker is ready yet")
                )
                return
            error = self.core.add_request(owner, msg)
            if error is not None:
                log.info("request_rejected", request_id=msg.request_id, reason=error.message)
                self._send_client(owner, error)
                return
            log.info(
                "request_queued",
                request_id=msg.request_id,
                num_prompt_tokens=len(msg.prompt_token_ids),
                max_tokens=msg.params.max_tokens,
                n=msg.params.n,
            )
            self._wake.set()
        elif isinstance(msg, AbortRequest):
            if self.core is not None:
                self._send_outputs(self.core.abort(owner, msg.request_id, msg.index, msg.finish_reason))
        elif isinstance(msg, InfoRequest):
            self._send_client(owner, self._info(msg.query_id))
        else:
            log.warning("unexpected_client_message", type=type(msg).__name__)

    def _info(self, query_id: int) -> InfoReply:
        ready = self.ready_msg
        if self.core is None or ready is None:
            return InfoReply(query_id, False, "", "", 0, 0, 0, 0, "")
        settings = self.core.settings
        return InfoReply(
            query_id=query_id,
            ready=True,
            model_root=ready.model_root,
            model_name=ready.model_name,
            max_model_len=settings.max_model_len,
            vocab_size=settings.vocab_size,
            block_size=settings.block_size,
            num_kv_blocks=settings.num_kv_blocks,
            metrics_text=self.core.metrics_text(),
        )

    def _send_client(self, owner: bytes, msg: Message) -> None:
        self._clients.send_multipart([owner, *encode(msg)], copy=False)

    def _send_outputs(self, outputs: list[Output]) -> None:
        by_owner: dict[bytes, list[SeqOutput]] = defaultdict(list)
        for owner, output in outputs:
            by_owner[owner].append(output)
            if output.finish_reason is not None:
                log.info(
                    "sequence_finished",
                    request_id=output.request_id,
                    index=output.index,
                    finish_reason=output.finish_reason,
                )
        for owner, outs in by_owner.items():
            self._send_client(owner, RequestOutputs(outs))

    # ----------------------------------------------------------------------------------------------------
    # workers

    async def _serve_workers(self) -> None:
        while True:
            identity, *frames = await self._workers.recv_multipart()
            try:
                msg = decode(frames)
            except CodecError as e:
                log.error("bad_worker_message", error=str(e))
                continue
            if isinstance(msg, Heartbeat):
                self._on_heartbeat(msg)
            elif isinstance(msg, StepOutput):
                self._on_step_output(identity, msg)
            elif isinstance(msg, WorkerReady):
                self._on_worker_ready(identity, msg)
            else:
                log.warning("unexpected_worker_message", type=type(msg).__name__)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        # Beats come from the worker's heartbeat socket, another identity: they match on the announced id.
        ready, watch = self.ready_msg, self._watch
        if ready is not None and watch is not None and msg.worker_id == ready.worker_id:
            watch.heard(time.monotonic())

    def _on_step_output(self, identity: bytes, msg: StepOutput) -> None:
        if identity != self._worker_id or self._watch is None:  # a worker declared dead, or replaced
            log.warning("stale_step_output_ignored", step_id=msg.step_id)
            return
        pending = self._pending_steps.get(msg.step_id)
        if pending is not None and not pending.done():
            self._watch.step_answered(time.monotonic())
            pending.set_result(msg)
        else:
            self._watch.heard(time.monotonic())

    def _on_worker_ready(self, identity: bytes, msg: WorkerReady) -> None:
        if self.core is not None:
            # A worker that announces itself again has lost its state: what ran on it cannot continue.
            log.warning("worker_restarted", num_failed_requests=len(self.core.live_requests()))
            self._drop_worker("the worker restarted; the request was lost")
        max_model_len = msg.max_model_len
        if self.config.max_model_len:
            max_model_len = min(max_model_len, self.config.max_model_len)
        config = self.config
        settings = SchedulerSettings(
            num_kv_blocks=msg.num_kv_blocks,
            block_size=msg.block_size,
            max_model_len=max_model_len,
            vocab_size=msg.vocab_size,
            eos_token_ids=tuple(msg.eos_token_ids),
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            num_cpu_blocks=msg.num_cpu_blocks,
            enable_prefix_caching=config.enable_prefix_caching,
            preemption_mode=config.preemption_mode,
            scheduling_policy=config.scheduling_policy,
            kv_policy=config.kv_policy,
        )
        self.core = Scheduler(settings)
        self.ready_msg = msg
        self._worker_id = identity
        self._watch = WorkerWatch(config.heartbeat_timeout_s, config.step_timeout_s, time.monotonic())
        log.info(
            "worker_ready", model=msg.model_root, worker_id=msg.worker_id, **dataclasses.asdict(settings)
        )

    def _drop_worker(self, message: str) -> None:
        """Fails every live request with UNAVAILABLE and forgets the worker, and the core with all its
        requests and KV bookkeeping; new requests are refused until a worker announces itself."""
        if self.core is not None:
            for owner, request_id in self.core.live_requests():
                self._send_client(owner, RequestError(request_id, ErrorKind.UNAVAILABLE, message))
        for pending in self._pending_steps.values():
            pending.cancel()
        self._pending_steps = {}
        self.core = None
        self.ready_msg = None
        self._worker_id = None
        self._watch = None

    async def _watchdog(self) -> None:
        period = min(1.0, max(0.01, min(self.config.heartbeat_timeout_s, self.config.step_timeout_s) / 4))
        while True:
            await asyncio.sleep(period)
            if self._watch is None:
                continue
            reason = self._watch.death_reason(time.monotonic())
            if reason is None:
                continue
            if self._workers.get(zmq.EVENTS) & zmq.POLLIN:
                continue  # worker messages wait to be read (this loop was busy): judge once they are
            self._declare_dead(reason)

    def _declare_dead(self, reason: str) -> None:
        assert self.core is not None and self._worker_id is not None
        log.error("worker_dead", reason=reason, num_failed_requests=len(self.core.live_requests()))
        # Should it come back (a stopped process continued), it must not serve plans of a core that is gone.
        self._workers.send_multipart([self._worker_id, *encode(Shutdown(f"declared dead: {reason}"))])
        self._drop_worker(f"{reason}; the request was lost")

    # ----------------------------------------------------------------------------------------------------
    # the engine loop

    async def _engine_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._run_steps()

    async def _run_steps(self) -> None:
        """Runs steps while there is work that can run, or until the worker goes away (a function of its
        own, so that no local keeps a dropped core and its requests alive)."""
        depth = 2 if self.config.async_scheduling else 1  # plans at the worker before waiting for one
        in_flight: list[asyncio.Future[StepOutput]] = []  # oldest first
        outputs: list[Output] = []  # of the last update, streamed while the worker runs the next step
        core = self.core
        while core is not None and (core.has_work or in_flight):
            plan = core.schedule()
            if plan.scheduled_seq_ids:
                assert self._worker_id is not None and self._watch is not None
                future = self._pending_steps[plan.step_id] = asyncio.get_running_loop().create_future()
                in_flight.append(future)
                self._workers.send_multipart([self._worker_id, *encode(plan)], copy=False)
                self._watch.step_sent(time.monotonic())
            elif not in_flight:
                break  # nothing can run until a request arrives or ends; _wake says when
            self._send_outputs(outputs)
            outputs = []
            if len(in_flight) < depth and plan.scheduled_seq_ids:
                continue  # room for one more plan at the worker: make it now
            try:
                step = await in_flight.pop(0)
            except asyncio.CancelledError:
                if self.core is core:
                    raise
                return  # the worker died or restarted: the core went with it, a new one starts empty
            if self.core is not core:
                return  # (it went between the answer and now)
            del self._pending_steps[step.step_id]
            outputs = core.update(step)
        self._send_outputs(outputs)
