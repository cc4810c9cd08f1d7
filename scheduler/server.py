"""The scheduler process: ZeroMQ sockets and an asyncio loop around the synchronous `Scheduler` core.

Two ROUTER sockets: clients (the api, ZeroMQ users) connect to `scheduler_address`, workers to
`worker_address`. One task reads each socket; the engine loop runs steps while there is work: schedule,
send the plan, wait for the worker's sampled tokens, update, stream the new tokens to their clients.
With `async_scheduling` (the default) the loop keeps two plans at the worker: it sends plan N+1 before it
waits for step N's tokens, so the worker starts step N+1 as soon as step N is done, and the scheduler's
own work (update, schedule, the codec, streaming) happens while the GPU runs. Client messages are handled
while steps are in flight; the core tolerates that (a sequence aborted mid-step just ignores its late
token, and its blocks are reused only by a later plan, which the worker runs after the ones before it).

Both sockets are CURVE servers locked with the cluster key (common/security.py): only processes holding it
connect. Every message is decoded into its typed class (a malformed one is dropped and logged with its
sender) and checked against the core's state before it touches anything; an exception while handling one
request fails that request, never the process.

The worker is declared dead the moment its connection closes (a killed process), when nothing (heartbeat,
step output) came from it for `heartbeat_timeout_s` (a stopped process), or when a step went unanswered for
`step_timeout_s` (a hung one): its requests fail with UNAVAILABLE, the core goes with all its requests and KV
bookkeeping, and new requests are refused until a worker announces itself again (the watch, and how it
tells its own stalls from the worker's: scheduler/liveness.py). The same worker announcing itself again (it
lost its connection, or reset itself) is accepted with an empty core; another worker announcing itself
while one serves is refused. A client whose connection closes (an api that died) has its
requests aborted, so their KV blocks go back to the pool at once.

`drain()` (SIGTERM) stops admission, lets the requests in flight finish, ends the rest after a timeout, and
tells the worker to shut down.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog
import zmq
import zmq.asyncio

from pagedserve.common.config import SchedulerConfig
from pagedserve.common.messages import (
    AbortRequest,
    CodecError,
    ErrorKind,
    Heartbeat,
    InfoRequest,
    KVSnapshotRequest,
    Message,
    RequestError,
    Shutdown,
    StepOutput,
    SubmitRequest,
    WorkerReady,
    decode,
    encode,
)
from pagedserve.common.security import ClusterKey, authenticate, load_cluster_key, secure_server
from pagedserve.common.socket_limits import Receiver, WireLimits, max_message_bytes
from pagedserve.scheduler.clients import ClientSender, info_reply, submitted_request_id
from pagedserve.scheduler.kv_events.stream import KVEventStream
from pagedserve.scheduler.kv_views import KVViews
from pagedserve.scheduler.liveness import (
    PeerConnections,
    WorkerWatch,
    source_fd,
    watch_disconnects,
    watch_worker,
)
from pagedserve.scheduler.request import Output
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.settings import SchedulerSettings

log = structlog.get_logger(process="scheduler")


class SchedulerServer:
    """Serves clients and drives the worker until cancelled."""

    def __init__(self, config: SchedulerConfig, key: ClusterKey | None = None) -> None:
        self.config = config
        self.key = key or load_cluster_key(config.cluster_key_file)
        self.core: Scheduler | None = None  # exists while a worker that announced itself is alive
        self.ready_msg: WorkerReady | None = None
        self.draining = False  # SIGTERM: no new requests; the worker is told to stop once those in flight end
        self._ctx = zmq.asyncio.Context()
        self._clients = self._ctx.socket(zmq.ROUTER)
        self._workers = self._ctx.socket(zmq.ROUTER)
        self._limits = WireLimits.of_scheduler(config)  # what the sockets' frame limits were worked out for
        for sock, receiver in (
            (self._clients, Receiver.SCHEDULER_CLIENTS),
            (self._workers, Receiver.SCHEDULER_WORKERS),
        ):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            secure_server(sock, self.key, max_message_bytes(receiver, self._limits))
        self._workers.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished worker must not block the loop
        self._to_clients = ClientSender(self._clients, on_unreachable=self._on_client_gone)
        self._client_peers = PeerConnections()
        self._worker_peers = PeerConnections()
        self._worker_id: bytes | None = None  # the ZeroMQ identity that plans go to
        self._watch: WorkerWatch | None = None  # exists while a worker is accepted
        # step id -> its output's future, for the plans at the worker (one, or two with async scheduling)
        self._pending_steps: dict[int, asyncio.Future[StepOutput]] = {}
        self._wake = asyncio.Event()
        self._kv_views = KVViews(config)  # /dashboard's snapshots and --kv-trace (scheduler/kv_views.py)
        self._kv_events = KVEventStream(config)  # --kv-events-config (scheduler/kv_events)

    async def run(self) -> None:
        config = self.config
        auth = authenticate(self._ctx, self.key)
        self._clients.bind(self.config.scheduler_address)
        self._workers.bind(self.config.worker_address)
        self._kv_events.start()
        log.info(
            "scheduler_listening",
            scheduler_address=self.config.scheduler_address,
            worker_address=self.config.worker_address,
            cluster_key=self.key.fingerprint,
        )
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._serve_clients())
                tasks.create_task(self._serve_workers())
                tasks.create_task(watch_disconnects(self._clients, self._client_peers, self._on_client_left))
                tasks.create_task(watch_disconnects(self._workers, self._worker_peers, self._on_worker_gone))
                tasks.create_task(self._engine_loop())
                timeout = min(config.heartbeat_timeout_s, config.step_timeout_s)
                watch = watch_worker(timeout, lambda: self._watch, self._workers, self._declare_dead)
                tasks.create_task(watch)
        finally:
            auth.stop()
            self._clients.close()
            self._workers.close()
            self._ctx.term()
            self._kv_views.close()
            self._kv_events.close()

    async def drain(self, timeout_s: float) -> None:
        """Stops admission, waits up to `timeout_s` for the requests in flight, ends the rest with
        UNAVAILABLE and tells the worker to shut down. The caller cancels `run()` afterwards."""
        self.draining = True
        core = self.core
        num_live = len(core.live_requests()) if core is not None else 0
        log.info("draining", num_requests=num_live, timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.core is not None and self.core.live_requests() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.core is not None:
            num_ended = len(self.core.live_requests())
            if num_ended:
                log.warning("drain_timeout", num_requests_ended=num_ended)
            self._fail_requests(ErrorKind.UNAVAILABLE, "the server is shutting down")
            self._workers.send_multipart([self._worker_id, *encode(Shutdown("the scheduler is stopping"))])
            self._drop_worker()
        await asyncio.sleep(0.1)  # let the last messages leave before run() closes the sockets

    # ----------------------------------------------------------------------------------------------------
    # clients

    async def _serve_clients(self) -> None:
        while True:
            identity, *frames = await self._clients.recv_multipart(copy=False)
            owner = identity.bytes
            try:
                self._on_client_frames(owner, source_fd(identity), [f.bytes for f in frames])
            except Exception:  # a bug on the receive path itself: this message is lost, the loop goes on
                log.exception("client_receive_failed", client=owner.hex())

    def _on_client_frames(self, owner: bytes, fd: int, frames: list[bytes]) -> None:
        self._client_peers.seen(owner, fd)
        self._to_clients.heard_from(owner)
        try:
            msg = decode(frames)
        except CodecError as e:
            log.warning("bad_client_message", client=owner.hex(), error=str(e))
            request_id = submitted_request_id(frames)
            if request_id is not None:  # its sender waits for an answer: tell it why there is none
                self._to_clients.send(owner, RequestError(request_id, ErrorKind.INVALID_REQUEST, str(e)))
            return
        try:
            self._handle_client(owner, msg)
        except Exception:
            self._client_message_failed(owner, msg)

    def _client_message_failed(self, owner: bytes, msg: Message) -> None:
        """A bug met while handling `msg`: it fails its own request, never the scheduler."""
        request_id = getattr(msg, "request_id", None)
        log.exception(
            "client_message_failed", client=owner.hex(), type=type(msg).__name__, request_id=request_id
        )
        if not isinstance(request_id, str):
            return
        self._to_clients.send(
            owner, RequestError(request_id, ErrorKind.INTERNAL, "the scheduler failed on it")
        )
        if self.core is not None:
            try:
                self._to_clients.send_outputs(self.core.abort(owner, request_id))
            except Exception:
                log.exception("abort_after_failure_failed", request_id=request_id)

    def _handle_client(self, owner: bytes, msg: Message) -> None:
        if isinstance(msg, SubmitRequest):
            refusal = "the server is shutting down" if self.draining else None
            if self.core is None:
                refusal = refusal or "no worker is ready yet"
            if refusal is not None:
                self._to_clients.send(owner, RequestError(msg.request_id, ErrorKind.UNAVAILABLE, refusal))
                return
            error = self.core.add_request(owner, msg)
            self._send_errors()
            if error is not None:
                log.info("request_rejected", request_id=msg.request_id, reason=error.message)
                self._to_clients.send(owner, error)
                return
            log.debug(
                "request_queued",
                request_id=msg.request_id,
                num_prompt_tokens=len(msg.prompt_token_ids),
                max_tokens=msg.params.max_tokens,
                n=msg.params.n,
            )
            self._wake.set()
        elif isinstance(msg, AbortRequest):
            if self.core is not None:
                self._to_clients.send_outputs(
                    self.core.abort(owner, msg.request_id, msg.index, msg.finish_reason)
                )
                self._send_errors()
        elif isinstance(msg, InfoRequest):
            events = self._kv_events.metrics_text()
            reply = info_reply(
                msg.query_id, self.core, self.ready_msg, self.draining, events, self.config.instance_id
            )
            self._to_clients.send(owner, reply)
        elif isinstance(msg, KVSnapshotRequest):
            self._to_clients.send(owner, self._kv_views.reply(self.core, msg))
        else:
            log.warning("unexpected_client_message", client=owner.hex(), type=type(msg).__name__)

    def _on_client_left(self, owner: bytes) -> None:
        self._to_clients.heard_from(owner)  # nothing more will be sent to it: forget it
        self._on_client_gone(owner)

    def _on_client_gone(self, owner: bytes) -> None:
        """A client's connection closed (an api that died, a ZeroMQ user that left): nobody reads its
        requests any more, so they end now and their KV blocks go back to the pool."""
        if self.core is None:
            return
        mine = [request_id for o, request_id in self.core.live_requests() if o == owner]
        if mine:
            log.warning("client_gone", client=owner.hex(), num_requests_aborted=len(mine))
        for request_id in mine:
            self.core.abort(owner, request_id)  # its final outputs would go nowhere
        self._send_errors()

    def _send_errors(self) -> None:
        """Sends the errors of the requests the core failed on an internal error (it ended them itself)."""
        if self.core is None:
            return
        for owner, error in self.core.take_errors():
            log.error("request_failed", request_id=error.request_id, reason=error.message)
            self._to_clients.send(owner, error)

    # ----------------------------------------------------------------------------------------------------
    # workers

    async def _serve_workers(self) -> None:
        while True:
            identity, *frames = await self._workers.recv_multipart(copy=False)
            sender = identity.bytes
            try:
                self._on_worker_frames(sender, source_fd(identity), [f.bytes for f in frames])
            except Exception:  # a bug on the receive path: this message is lost, the loop goes on
                log.exception("worker_receive_failed", worker=sender.hex())

    def _on_worker_frames(self, sender: bytes, fd: int, frames: list[bytes]) -> None:
        self._worker_peers.seen(sender, fd)
        try:
            msg = decode(frames)
        except CodecError as e:
            log.error("bad_worker_message", worker=sender.hex(), error=str(e))
            return
        if isinstance(msg, Heartbeat):
            self._on_heartbeat(msg)
        elif isinstance(msg, StepOutput):
            self._on_step_output(sender, msg)
        elif isinstance(msg, WorkerReady):
            self._on_worker_ready(sender, msg)
        else:
            log.warning("unexpected_worker_message", worker=sender.hex(), type=type(msg).__name__)

    def _on_heartbeat(self, msg: Heartbeat) -> None:
        # Beats come from the worker's heartbeat socket, another identity: they match on the announced id.
        ready, watch = self.ready_msg, self._watch
        if ready is not None and watch is not None and msg.worker_id == ready.worker_id:
            watch.heard(time.monotonic())

    def _on_step_output(self, identity: bytes, msg: StepOutput) -> None:
        if identity != self._worker_id or self._watch is None or self.core is None:
            log.warning("stale_step_output_ignored", worker=identity.hex(), step_id=msg.step_id)
            return
        pending = self._pending_steps.get(msg.step_id)
        if pending is None or pending.done():
            log.warning("unexpected_step_output", worker=identity.hex(), step_id=msg.step_id)
            self._watch.heard(time.monotonic())
            return
        problem = self.core.check_output(msg)
        if problem is not None:
            # Never trusted: the requests that sample in that step fail (the worker drops them with the next
            # plan), and the step closes empty so that the others go on.
            log.error("bad_step_output", worker=identity.hex(), step_id=msg.step_id, problem=problem)
            msg = self.core.fail_step(msg.step_id)
        self._watch.step_answered(time.monotonic())
        pending.set_result(msg)

    def _on_worker_ready(self, identity: bytes, msg: WorkerReady) -> None:
        if self.core is not None:
            assert self.ready_msg is not None and self._watch is not None
            alive = self._watch.death_reason(time.monotonic()) is None
            if msg.worker_id != self.ready_msg.worker_id and alive:
                # One worker (group) serves a scheduler: a second one would take the first one's requests.
                log.warning(
                    "second_worker_refused", worker_id=msg.worker_id, serving=self.ready_msg.worker_id
                )
                self._workers.send_multipart(
                    [identity, *encode(Shutdown("another worker serves this scheduler"))]
                )
                return
            # The worker announces itself again: it has lost its state, so what ran on it cannot continue.
            log.warning("worker_restarted", num_failed_requests=len(self.core.live_requests()))
            self._fail_requests(ErrorKind.UNAVAILABLE, "the worker restarted; the request was lost")
            self._drop_worker()
        config = self.config
        settings = SchedulerSettings.from_config(config, msg)
        if settings.max_num_seqs > self._limits.seqs:  # the step outputs' frame limit assumes no more
            log.warning("max_num_seqs_capped", announced=settings.max_num_seqs, used=self._limits.seqs)
            settings = dataclasses.replace(settings, max_num_seqs=self._limits.seqs)
        self.core = Scheduler(settings)
        self.ready_msg = msg
        self._worker_id = identity
        self._watch = WorkerWatch(config.heartbeat_timeout_s, config.step_timeout_s, time.monotonic())
        log.info(
            "worker_ready", model=msg.model_root, worker_id=msg.worker_id, **dataclasses.asdict(settings)
        )

    def _on_worker_gone(self, identity: bytes) -> None:
        if identity == self._worker_id and self.core is not None:
            self._declare_dead("the worker's connection closed (the process exited)")

    def _fail_requests(self, kind: str, message: str) -> None:
        """Ends every live request with an error to its client."""
        if self.core is not None:
            for owner, request_id in self.core.live_requests():
                self._to_clients.send(owner, RequestError(request_id, kind, message))

    def _drop_worker(self) -> None:
        """Forgets the worker, and the core with all its requests and KV bookkeeping (tell the clients
        first); new requests are refused until a worker announces itself."""
        for pending in self._pending_steps.values():
            pending.cancel()
        self._pending_steps = {}
        self._kv_views.forget()
        self._kv_events.cleared()
        self.core = None
        self.ready_msg = None
        self._worker_id = None
        self._watch = None

    def _declare_dead(self, reason: str, kind: str = ErrorKind.UNAVAILABLE, reset: bool = False) -> None:
        """Fails the worker's requests and forgets it; it is told to exit, or with `reset` (a stopped
        process: scheduler/liveness.py) to forget its sequences and announce itself again if it continues."""
        assert self.core is not None and self._worker_id is not None
        log.error("worker_dead", reason=reason, num_failed_requests=len(self.core.live_requests()))
        # Should it come back (a stopped process continued), it must not serve plans of a core that is gone.
        shutdown = Shutdown(f"declared dead: {reason}", reannounce=reset)
        self._workers.send_multipart([self._worker_id, *encode(shutdown)])
        self._fail_requests(kind, f"{reason}; the request was lost")
        self._drop_worker()

    # ----------------------------------------------------------------------------------------------------
    # the engine loop

    async def _engine_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self._run_steps()
            except Exception:
                # A bug in the core or here: its state, and so the worker's, cannot be trusted. The requests
                # fail with an internal error, the worker is told to stop (its supervisor starts it afresh),
                # and the scheduler goes on serving once a worker announces itself.
                log.exception("engine_loop_failed")
                if self.core is not None:
                    self._declare_dead("the scheduler failed on a step", ErrorKind.INTERNAL)

    async def _run_steps(self) -> None:
        """Runs steps while there is work that can run, or until the worker goes away (a function of its
        own, so that no local keeps a dropped core and its requests alive)."""
        depth = 2 if self.config.async_scheduling else 1  # plans at the worker before waiting for one
        in_flight: list[asyncio.Future[StepOutput]] = []  # oldest first
        outputs: list[Output] = []  # of the last update, streamed while the worker runs the next step
        core = self.core
        while core is not None and (core.has_work or in_flight):
            plan = core.schedule()
            if not plan.is_noop:  # (a plan that only swaps or frees must reach the worker too)
                assert self._worker_id is not None and self._watch is not None
                future = self._pending_steps[plan.step_id] = asyncio.get_running_loop().create_future()
                in_flight.append(future)
                self._workers.send_multipart([self._worker_id, *encode(plan)], copy=False)
                self._watch.step_sent(time.monotonic())
            elif not in_flight:
                break  # nothing can run until a request arrives or ends; _wake says when
            self._to_clients.send_outputs(outputs)
            outputs = []
            # Room for one more plan at the worker: make it now, unless the next would draft (it needs this
            # step's tokens: docs/speculative.md); a drafting plan's successor waits in `schedule()` anyway
            if len(in_flight) < depth and plan.scheduled_seq_ids and not core.speculating:
                continue
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
            self._send_errors()
            self._kv_views.after_step(core)
            self._kv_events.after_step(core)
        self._to_clients.send_outputs(outputs)
        if self.core is core:
            self._kv_views.after_step(core)  # the pool as the work ends (when due)
            self._kv_events.after_step(core)
