"""The scheduler process: ZeroMQ sockets and an asyncio loop around the synchronous `Scheduler` core.

Two ROUTER sockets: clients (the api, ZeroMQ users) connect to `scheduler_address`, workers to
`worker_address`. One task reads each socket; the engine loop runs steps while there is work: schedule,
send the plan, wait for the worker's sampled tokens, update, stream the new tokens to their clients.
Client messages are handled while a step is in flight; the core tolerates that (a sequence aborted
mid-step just ignores its late token, and its blocks are reused only by a later plan, which the worker
runs after the current one).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import defaultdict

import structlog
import zmq
import zmq.asyncio

from common.config import SchedulerConfig
from common.messages import (
    AbortRequest,
    CodecError,
    ErrorKind,
    InfoReply,
    InfoRequest,
    Message,
    RequestError,
    RequestOutputs,
    SeqOutput,
    StepOutput,
    SubmitRequest,
    WorkerReady,
    decode,
    encode,
)
from scheduler.scheduler import Output, Scheduler, SchedulerSettings

log = structlog.get_logger(process="scheduler")


class SchedulerServer:
    """Serves clients and drives the worker until cancelled."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.core: Scheduler | None = None  # exists once a worker has announced itself
        self.ready_msg: WorkerReady | None = None
        self._ctx = zmq.asyncio.Context()
        self._clients = self._ctx.socket(zmq.ROUTER)
        self._workers = self._ctx.socket(zmq.ROUTER)
        for sock in (self._clients, self._workers):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished client must not block the loop
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
        self._worker_id: bytes | None = None
        self._pending_step: asyncio.Future[StepOutput] | None = None
        self._pending_step_id = -1
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
            if isinstance(msg, WorkerReady):
                self._on_worker_ready(identity, msg)
            elif isinstance(msg, StepOutput):
                if identity == self._worker_id and self._pending_step is not None:
                    if msg.step_id == self._pending_step_id and not self._pending_step.done():
                        self._pending_step.set_result(msg)
            else:
                log.warning("unexpected_worker_message", type=type(msg).__name__)

    def _on_worker_ready(self, identity: bytes, msg: WorkerReady) -> None:
        if self.core is not None:
            # A worker that announces itself again has lost its state: what ran on it cannot continue.
            self._fail_all("the worker restarted; the request was lost")
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
        log.info("worker_ready", model=msg.model_root, **dataclasses.asdict(settings))

    def _fail_all(self, message: str) -> None:
        assert self.core is not None
        for owner, request_id in self.core.live_requests():
            self._send_client(owner, RequestError(request_id, ErrorKind.UNAVAILABLE, message))
        if self._pending_step is not None and not self._pending_step.done():
            self._pending_step.cancel()

    # ----------------------------------------------------------------------------------------------------
    # the engine loop

    async def _engine_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            outputs: list[Output] = []  # of the last step, streamed while the worker runs the next one
            while self.core is not None and self.core.has_work:
                core = self.core
                plan = core.schedule()
                if not plan.scheduled_seq_ids:
                    break  # nothing can run until a request arrives or ends; _wake says when
                assert self._worker_id is not None
                self._pending_step = asyncio.get_running_loop().create_future()
                self._pending_step_id = plan.step_id
                self._workers.send_multipart([self._worker_id, *encode(plan)], copy=False)
                self._send_outputs(outputs)
                outputs = []
                try:
                    step = await self._pending_step
                except asyncio.CancelledError:
                    if self.core is core:
                        raise
                    continue  # the worker restarted; its new core starts empty
                finally:
                    self._pending_step = None
                outputs = core.update(step)
            self._send_outputs(outputs)
