"""The ZeroMQ client library: submit prompts to the scheduler and stream their outputs back.

One DEALER socket carries every request of a client; one receive task decodes what the scheduler sends and
hands each sequence's new tokens to its request's queue, detokenized and checked for stop strings on the
way. `AsyncEngineClient` is the asyncio API; `EngineClient` wraps it for plain threads.

The socket is a CURVE client holding the cluster key (common/security.py), without which the scheduler
refuses the connection. The client watches its connection: when the scheduler's connection closes (its
process exited), every request in flight fails at once with UNAVAILABLE, and so do new ones until it is back
(ZeroMQ reconnects by itself); when the scheduler stops answering (a hung process) for `liveness_timeout_s`,
the requests in flight fail the same way.

    async with AsyncEngineClient("tcp://127.0.0.1:5570") as client:
        [handle] = await client.submit(["Hello"], SamplingParams(max_tokens=8))
        async for delta in handle:
            print(delta.index, delta.text, delta.finish_reason)
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from client.request_stream import RequestHandle, RequestResult, SequenceDelta, SequenceResult, _RequestState
from common.config import default_cluster_key_file
from common.log import get_logger
from common.messages import (
    MAX_INT32,
    MAX_NAME_CHARS,
    MAX_PROMPT_TOKENS,
    AbortRequest,
    CodecError,
    ErrorKind,
    InfoReply,
    InfoRequest,
    Message,
    RequestError,
    RequestOutputs,
    SamplingParams,
    SubmitRequest,
    decode,
    encode,
)
from common.monitor import open_monitor
from common.security import load_cluster_key, secure_client

__all__ = [
    "AsyncEngineClient",
    "ClientClosed",
    "EngineClient",
    "Prompt",
    "RequestHandle",
    "RequestRejected",
    "RequestResult",
    "SequenceDelta",
    "SequenceResult",
    "SyncRequestHandle",
    "load_tokenizer",
]

Prompt = str | Sequence[int]  # text (tokenized here) or token ids (sent exactly as given)
T = TypeVar("T")
log = get_logger(component="client")
LIVENESS_PING_S = 1.0  # with requests in flight and nothing heard for this long, the client asks for info
CONNECTION_EVENTS = (
    zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
)


class RequestRejected(Exception):
    """The request cannot be served: refused by the scheduler, or found invalid before sending."""

    def __init__(self, kind: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{kind}: {message}")
        self.kind = kind  # an ErrorKind value
        self.message = message
        self.request_id = request_id


class ClientClosed(Exception):
    """The client was closed while the request was still running."""


def _request_options_problem(priority: object, cache_salt: object) -> str | None:
    """Why `priority` / `cache_salt` cannot be sent, or None (they must fit the wire's 64-bit int / str)."""
    if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**63) <= priority < 2**63:
        return f"priority must be a 64-bit integer, got {priority!r}"
    if not isinstance(cache_salt, str) or len(cache_salt) > MAX_NAME_CHARS:
        return f"cache_salt must be a string of at most {MAX_NAME_CHARS} characters"
    return None


def _prompt_problem(prompt: list[int]) -> str | None:
    """Why a tokenized prompt cannot be sent (the scheduler would drop it undecoded), or None."""
    if not prompt:
        return "the prompt is empty"
    if len(prompt) > MAX_PROMPT_TOKENS:
        return f"the prompt has {len(prompt)} tokens, more than the {MAX_PROMPT_TOKENS} a request may carry"
    if not all(0 <= t <= MAX_INT32 for t in prompt):
        return f"prompt token ids must be in [0, {MAX_INT32}]"
    return None


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The transformers tokenizer of a local checkpoint directory."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


class AsyncEngineClient:
    """Talks to the scheduler over one ZeroMQ DEALER socket; use from one asyncio event loop.

    `tokenizer` is a transformers tokenizer, a checkpoint directory to load one from, or None to load the
    one of the checkpoint the worker serves (InfoReply.model_root) when first needed. Without a tokenizer
    (or with detokenize=False) deltas carry no text, and text prompts and stop strings are refused.
    `cluster_key_file` holds the cluster's CURVE key (None: PAGEDSERVE_CLUSTER_KEY_FILE, else the default).
    """

    def __init__(
        self,
        address: str,
        tokenizer: Any = None,
        *,
        detokenize: bool = True,
        info_timeout: float = 5.0,
        cluster_key_file: str | None = None,
        liveness_timeout_s: float = 10.0,
    ) -> None:
        self.address = address
        self._key_file = cluster_key_file or default_cluster_key_file()
        self._liveness_timeout_s = liveness_timeout_s
        self._connected = asyncio.Event()  # the scheduler's connection is up (handshake done)
        self._last_heard = 0.0  # monotonic time of the scheduler's last message
        self._tokenizer_arg = tokenizer
        self._tokenizer: Any = tokenizer if not isinstance(tokenizer, str | Path | None) else None
        self._tokenizer_lock = asyncio.Lock()
        self._tokenizer_failed = False  # the checkpoint the scheduler named could not be loaded here
        self._detokenize = detokenize
        self._info_timeout = info_timeout
        self._id_prefix = uuid.uuid4().hex[:12]
        self._request_counter = itertools.count()
        self._query_counter = itertools.count()
        self._requests: dict[str, _RequestState] = {}
        self._info_waiters: dict[int, asyncio.Future[InfoReply]] = {}
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []  # receiving, watching the connection, liveness pings
        self._closed = False

    async def start(self) -> None:
        """Connects the socket and starts the receive task; called by every method, so optional."""
        if self._closed:
            raise ClientClosed("the client is closed")
        if self._socket is not None:
            return
        key = await asyncio.to_thread(load_cluster_key, self._key_file)
        socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 1000)  # long enough to deliver the aborts that close() sends
        # No high-water marks: a dropped output would leave its request waiting forever.
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.RCVHWM, 0)
        secure_client(socket, key)
        monitor = open_monitor(socket, CONNECTION_EVENTS)
        socket.connect(self.address)
        self._socket = socket
        self._tasks = [
            asyncio.create_task(self._receive_loop(), name="engine-client-receive"),
            asyncio.create_task(self._watch_connection(monitor), name="engine-client-connection"),
            asyncio.create_task(self._keep_alive(), name="engine-client-liveness"),
        ]

    async def __aenter__(self) -> AsyncEngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        """Whether the scheduler's connection is up (it may still be hung: see `liveness_timeout_s`)."""
        return self._connected.is_set()

    @property
    def num_unfinished(self) -> int:
        """Requests submitted through this client that have not finished."""
        return len(self._requests)

    def _send_nowait(self, msg: Message) -> None:
        assert self._socket is not None
        future = self._socket.send_multipart(encode(msg))
        future.add_done_callback(lambda f: f.cancelled() or f.exception())  # never "exception not retrieved"

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        try:
            while True:
                frames = await self._socket.recv_multipart()
                self._last_heard = time.monotonic()
                try:
                    msg = decode(frames)
                except CodecError as e:
                    log.warning("bad_message_from_scheduler", error=str(e))
                    continue
                self._dispatch(msg)
        except (asyncio.CancelledError, zmq.ContextTerminated, zmq.ZMQError):
            pass
        finally:
            for state in self._requests.values():
                state.fail(ClientClosed("the client stopped receiving"))
            self._requests.clear()

    async def _watch_connection(self, monitor: zmq.asyncio.Socket) -> None:
        """Follows the scheduler's connection: up after each handshake, down (and every request in flight
        lost) when it closes."""
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._last_heard = time.monotonic()
                    self._connected.set()
                    log.info("scheduler_connected", address=self.address)
                elif event == zmq.EVENT_DISCONNECTED:
                    if self._connected.is_set():
                        log.warning("scheduler_disconnected", address=self.address)
                    self._connected.clear()
                    self._fail_all("the scheduler went away; the request was lost")
                else:  # a scheduler that does not hold our key, or no CURVE server at all
                    log.error("scheduler_handshake_failed", address=self.address, event=int(event))
        except (asyncio.CancelledError, zmq.ContextTerminated, zmq.ZMQError):
            pass
        finally:
            monitor.close(linger=0)

    async def _keep_alive(self) -> None:
        """While requests are in flight, makes sure the scheduler still answers: it is asked for info when
        quiet, and its requests fail when it stays silent for `liveness_timeout_s` (a hung process)."""
        while True:
            await asyncio.sleep(min(LIVENESS_PING_S, self._liveness_timeout_s / 4))
            if not self._requests or not self._connected.is_set():
                continue
            silent = time.monotonic() - self._last_heard
            if silent > self._liveness_timeout_s:
                log.error(
                    "scheduler_not_answering", silent_s=round(silent, 1), num_requests=len(self._requests)
                )
                self._fail_all(f"the scheduler did not answer for {silent:.0f} s; the request was lost")
                self._last_heard = time.monotonic()  # the next requests get a full timeout of their own
            elif silent > LIVENESS_PING_S:
                self._send_nowait(InfoRequest(next(self._query_counter)))  # any answer counts

    def _fail_all(self, message: str) -> None:
        """Ends every request in flight with UNAVAILABLE (they are gone at the scheduler, or may be)."""
        requests, self._requests = self._requests, {}
        for request_id, state in requests.items():
            state.fail(RequestRejected(ErrorKind.UNAVAILABLE, message, request_id))
            if self._connected.is_set():  # a hung scheduler that comes back must not run them on
                self._send_nowait(AbortRequest(request_id))

    def _dispatch(self, msg: Message) -> None:
        if isinstance(msg, RequestOutputs):
            for out in msg.outputs:
                state = self._requests.get(out.request_id)
                if state is None:
                    continue  # finished or aborted here already
                try:
                    abort = state.on_output(out)
                except Exception as e:  # a detokenizer failure must not stop every other request
                    log.exception("output_failed", request_id=out.request_id)
                    self._requests.pop(out.request_id, None)
                    self._send_nowait(AbortRequest(out.request_id))
                    state.fail(RequestRejected(ErrorKind.INTERNAL, f"client failed on output: {e}"))
                    continue
                if abort is not None:
                    self._send_nowait(abort)
                if state.done:
                    del self._requests[out.request_id]
        elif isinstance(msg, RequestError):
            state = self._requests.pop(msg.request_id, None)
            if state is not None:
                state.fail(RequestRejected(msg.kind, msg.message, msg.request_id))
        elif isinstance(msg, InfoReply):
            waiter = self._info_waiters.pop(msg.query_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
        else:
            log.warning("unexpected_message_from_scheduler", type=type(msg).__name__)

    async def info(self, timeout: float | None = None) -> InfoReply:
        """Asks the scheduler for its state. Raises TimeoutError when it does not answer in time."""
        await self.start()
        query_id = next(self._query_counter)
        waiter: asyncio.Future[InfoReply] = asyncio.get_running_loop().create_future()
        self._info_waiters[query_id] = waiter
        try:
            self._send_nowait(InfoRequest(query_id))
            return await asyncio.wait_for(waiter, self._info_timeout if timeout is None else timeout)
        finally:
            self._info_waiters.pop(query_id, None)

    async def get_tokenizer(self) -> Any:
        """The tokenizer, loading it on first use; None when there is none (yet).

        Raises TimeoutError when it must ask the scheduler for the checkpoint and gets no answer.
        """
        if self._tokenizer is not None or self._tokenizer_failed:
            return self._tokenizer
        async with self._tokenizer_lock:
            if self._tokenizer is not None or self._tokenizer_failed:
                return self._tokenizer
            path = self._tokenizer_arg
            if path is not None:
                self._tokenizer = await asyncio.to_thread(load_tokenizer, path)
                return self._tokenizer
            reply = await self.info()
            if not reply.ready or not reply.model_root:
                return None  # try again once a worker has announced its checkpoint
            try:
                self._tokenizer = await asyncio.to_thread(load_tokenizer, reply.model_root)
            except (OSError, ValueError) as e:  # a scheduler on another machine: its path is not ours
                log.warning("tokenizer_unavailable", model_root=reply.model_root, error=str(e))
                self._tokenizer_failed = True
            return self._tokenizer

    def _new_request_id(self) -> str:
        return f"{self._id_prefix}-{next(self._request_counter)}"

    async def submit(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str = "",
    ) -> list[RequestHandle]:
        """Submits one request per prompt, all with `params`; returns their handles in order.

        `prompts` is a list of prompts, or a single prompt: a string or a list of token ids. `priority`
        orders requests under the scheduler's priority policy (lower first); a non-empty `cache_salt`
        keeps the request's prefix-cache entries apart from those of other salts. Raises RequestRejected
        (kind invalid_request_error) for parameters or prompts that can never be served.
        """
        params = params or SamplingParams()
        if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        problem = params.validate() or _request_options_problem(priority, cache_salt)
        if problem is not None:
            raise RequestRejected(ErrorKind.INVALID_REQUEST, problem)
        await self.start()
        try:
            await asyncio.wait_for(self._connected.wait(), self._info_timeout)
        except TimeoutError:
            raise RequestRejected(ErrorKind.UNAVAILABLE, "the scheduler is not reachable") from None
        needs_text = bool(params.stop) or any(isinstance(p, str) for p in prompts)
        tokenizer = None
        if needs_text or self._detokenize:
            try:
                tokenizer = await self.get_tokenizer()
            except TimeoutError:
                if needs_text:
                    raise RequestRejected(ErrorKind.UNAVAILABLE, "the scheduler does not answer") from None
        if needs_text and tokenizer is None:
            raise RequestRejected(
                ErrorKind.UNAVAILABLE, "text prompts and stop strings need a tokenizer, and none is known yet"
            )
        token_prompts = self._tokenize(prompts, tokenizer)
        problem = next(filter(None, map(_prompt_problem, token_prompts)), None)
        if problem is not None:
            raise RequestRejected(ErrorKind.INVALID_REQUEST, problem)
        detokenizer = tokenizer if (self._detokenize or params.stop) else None
        states = []
        try:
            for prompt in token_prompts:
                state = _RequestState(self._new_request_id(), prompt, params, detokenizer)
                self._requests[state.request_id] = state
                states.append(state)
                assert self._socket is not None
                request = SubmitRequest(state.request_id, prompt, params, priority, cache_salt)
                await self._socket.send_multipart(encode(request))
        except BaseException:  # cancelled half-way: nobody will read these requests, so stop them
            for state in states:
                self.abort(state.request_id)
            raise
        return [RequestHandle(state, self.abort) for state in states]

    @staticmethod
    def _tokenize(prompts: Sequence[Prompt], tokenizer: Any) -> list[list[int]]:
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else [])
        return [list(next(encoded)) if isinstance(p, str) else [int(t) for t in p] for p in prompts]

    async def submit_one(
        self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0, cache_salt: str = ""
    ) -> RequestHandle:
        """Submits a single prompt; see `submit`."""
        [handle] = await self.submit([prompt], params, priority=priority, cache_salt=cache_salt)
        return handle

    def abort(self, request_id: str) -> None:
        """Ends a request now: its unfinished sequences end with "abort" and the scheduler frees them.

        Not a coroutine, so that cleanup code (finally blocks, cancelled tasks) can always call it.
        """
        state = self._requests.pop(request_id, None)
        if state is None:
            return
        state.abort_locally()
        if self._socket is not None and not self._closed:
            self._send_nowait(AbortRequest(request_id))

    async def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str = "",
    ) -> list[RequestResult]:
        """Submits the prompts and waits for all of them; results are in prompt order."""
        handles = await self.submit(prompts, params, priority=priority, cache_salt=cache_salt)
        try:
            return list(await asyncio.gather(*(h.result() for h in handles)))
        finally:
            for h in handles:
                if not h.finished:
                    self.abort(h.request_id)

    async def close(self) -> None:
        """Aborts the unfinished requests at the scheduler and closes the socket."""
        if self._closed:
            return
        self._closed = True
        if self._socket is None:
            return
        for request_id, state in list(self._requests.items()):
            self._send_nowait(AbortRequest(request_id))
            state.fail(ClientClosed("the client was closed"))
        self._requests.clear()
        await asyncio.sleep(0)  # let the queued aborts reach the socket before it closes
        # Stop the monitor before its reader goes: libzmq's I/O thread would block sending it an event
        # (a disconnect while the socket lingers) with nobody at the other end, and stall the whole context.
        self._socket.disable_monitor()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.close()


class SyncRequestHandle:
    """A RequestHandle for threads: iterate it with `for`, or call `result()`."""

    def __init__(self, client: EngineClient, handle: RequestHandle) -> None:
        self._client = client
        self._handle = handle
        self.request_id = handle.request_id
        self.prompt_token_ids = handle.prompt_token_ids

    def __iter__(self) -> Iterator[SequenceDelta]:
        while True:
            try:
                yield self._client._run(self._handle.__anext__())
            except StopAsyncIteration:
                return

    def result(self, timeout: float | None = None) -> RequestResult:
        return self._client._run(self._handle.result(), timeout)

    def abort(self) -> None:
        self._client.abort(self.request_id)


class EngineClient:
    """The blocking flavour: an AsyncEngineClient on an event loop in a background thread."""

    def __init__(self, address: str, tokenizer: Any = None, **kwargs: Any) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="engine-client", daemon=True)
        self._thread.start()

        async def make() -> AsyncEngineClient:  # created on the loop, so its socket belongs to it
            client = AsyncEngineClient(address, tokenizer, **kwargs)
            await client.start()
            return client

        self._client = self._run(make())

    def _run(self, coro: Awaitable[T], timeout: float | None = None) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)  # type: ignore[arg-type]

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def info(self, timeout: float | None = None) -> InfoReply:
        return self._run(self._client.info(timeout))

    def get_tokenizer(self) -> Any:
        return self._run(self._client.get_tokenizer())

    def submit(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str = "",
    ) -> list[SyncRequestHandle]:
        handles = self._run(self._client.submit(prompts, params, priority=priority, cache_salt=cache_salt))
        return [SyncRequestHandle(self, h) for h in handles]

    def submit_one(
        self, prompt: Prompt, params: SamplingParams | None = None, *, priority: int = 0, cache_salt: str = ""
    ) -> SyncRequestHandle:
        [handle] = self.submit([prompt], params, priority=priority, cache_salt=cache_salt)
        return handle

    def abort(self, request_id: str) -> None:
        self._loop.call_soon_threadsafe(self._client.abort, request_id)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
        cache_salt: str = "",
    ) -> list[RequestResult]:
        return self._run(self._client.generate(prompts, params, priority=priority, cache_salt=cache_salt))

    def close(self) -> None:
        """Aborts unfinished requests, closes the socket and stops the background thread."""
        if self._loop.is_closed():
            return
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
