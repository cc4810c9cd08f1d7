"""A stand-in for the scheduler: a ZeroMQ ROUTER that speaks the client protocol deterministically.

Sequence `i` of a request generates, at its step `k`, the prompt token `prompt[(start + i + k) % len(prompt)]`
(`start` is the `output_start` option, 0 by default), so a test chooses the output by choosing the prompt.
With `scripted` tokens, every sequence generates those instead, then EOS.
It honours n, max_tokens, stop_token_ids, EOS, ignore_eos and logprobs, validates like the real scheduler,
and records every message it receives (`submits()` shows each request's priority and cache_salt). A prompt
seen before with the same cache_salt reports its whole blocks, bar the last token's, as cached.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import msgspec
import zmq
import zmq.asyncio

from pagedserve.common.config import default_cluster_key_file
from pagedserve.common.messages import (
    AbortRequest,
    CodecError,
    ErrorKind,
    FinishReason,
    InfoReply,
    InfoRequest,
    KVSnapshot,
    KVSnapshotRequest,
    Message,
    RequestError,
    RequestOutputs,
    SamplingParams,
    SeqOutput,
    SubmitRequest,
    TokenLogprobs,
    decode,
    encode,
)
from pagedserve.common.security import authenticate, load_cluster_key, secure_server
from pagedserve.common.socket_limits import Receiver, max_message_bytes
from pagedserve.scheduler.kv_views import empty_snapshot


@dataclass
class FakeSequence:
    identity: bytes
    request_id: str
    index: int
    prompt: list[int]
    params: SamplingParams
    num_cached_tokens: int
    start: int
    generated: list[int] = field(default_factory=list)
    finished: bool = False
    script: tuple[int, ...] = ()  # when given, the tokens generated, in order, then a stop

    def next_token(self) -> int:
        if self.script:
            return self.script[len(self.generated) % len(self.script)]
        return self.prompt[(self.start + self.index + len(self.generated)) % len(self.prompt)]


def fake_logprobs(token_id: int, step: int, k: int, vocab_size: int) -> TokenLogprobs:
    """A deterministic logprob for a token and its top-k alternatives (the sampled token ranks first)."""
    logprob = -0.25 * (step % 4 + 1)
    top_ids = [(token_id + j) % vocab_size for j in range(k)]
    return TokenLogprobs(logprob, top_ids, [logprob - j for j in range(k)])


class FakeScheduler:
    """The client side of the scheduler, without a model. Use `async with`, or start()/stop()."""

    def __init__(
        self,
        *,
        vocab_size: int = 4096,
        max_model_len: int = 256,
        eos_token_ids: tuple[int, ...] = (),
        model_root: str = "",
        model_name: str = "tiny-llama",
        block_size: int = 16,
        num_kv_blocks: int = 256,
        step_delay: float = 0.0,
        ready: bool = True,
        answer_info: bool = True,
        late_tokens_after_abort: int = 0,
        output_start: int = 0,
        scheduling_policy: str = "fcfs",
        scripted: tuple[int, ...] = (),
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.model_root = model_root
        self.model_name = model_name
        self.block_size = block_size
        self.num_kv_blocks = num_kv_blocks
        self.step_delay = step_delay  # seconds between steps: lets tests act while requests still run
        self.ready = ready
        self.answer_info = answer_info  # False: InfoRequests go unanswered, like a hung scheduler
        self.kv_snapshot: KVSnapshot | None = None  # what KVSnapshotRequests get (None: an empty pool)
        self.late_tokens_after_abort = late_tokens_after_abort  # tokens still sent after an abort
        self.output_start = output_start  # where in the prompt the echo starts
        self.scheduling_policy = scheduling_policy  # "fcfs" refuses a non-zero priority, as the real one
        # Non-empty: every sequence generates these tokens instead of the echo, then stops (a test may
        # change it between requests)
        self.scripted = scripted
        self.received: list[Message] = []
        self.address = ""
        self._active: list[FakeSequence] = []
        self._seen_prompts: set[tuple[str, tuple[int, ...]]] = set()  # (cache_salt, prompt)
        self._work = asyncio.Event()
        self._socket: zmq.asyncio.Socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> FakeScheduler:
        # Locked with the cluster key like the real one: the api's client holds it (common/security.py).
        key = load_cluster_key(default_cluster_key_file())
        self._ctx = zmq.asyncio.Context()
        self._auth = authenticate(self._ctx, key)
        self._socket = self._ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        secure_server(self._socket, key, max_message_bytes(Receiver.SCHEDULER_CLIENTS))
        self._socket.bind("tcp://127.0.0.1:*")
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._step_loop())]
        return self

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._socket is not None:
            self._socket.close()
            self._auth.stop()
            self._ctx.term()

    async def __aenter__(self) -> FakeScheduler:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def num_running(self) -> int:
        return sum(not s.finished for s in self._active)

    def aborts(self) -> list[AbortRequest]:
        return [m for m in self.received if isinstance(m, AbortRequest)]

    def submits(self) -> list[SubmitRequest]:
        return [m for m in self.received if isinstance(m, SubmitRequest)]

    async def _send(self, identity: bytes, msg: Message) -> None:
        assert self._socket is not None
        await self._socket.send_multipart([identity, *encode(msg)])

    async def _receive_loop(self) -> None:
        assert self._socket is not None
        while True:
            identity, *frames = await self._socket.recv_multipart()
            try:
                msg = decode(frames)
            except CodecError:
                continue
            self.received.append(msg)
            if isinstance(msg, InfoRequest) and self.answer_info:
                await self._send(identity, self._info(msg.query_id))
            elif isinstance(msg, KVSnapshotRequest) and self.answer_info:  # the dashboard (tests/dashboard)
                await self._send(identity, kv_snapshot_reply(self.kv_snapshot, msg))
            elif isinstance(msg, SubmitRequest):
                await self._submit(identity, msg)
            elif isinstance(msg, AbortRequest):
                await self._abort(identity, msg)

    def _info(self, query_id: int) -> InfoReply:
        metrics = (
            "# TYPE pagedserve_requests_total counter\n"
            f"pagedserve_requests_total {len(self.submits())}\n"
            "# TYPE pagedserve_num_running gauge\n"
            f"pagedserve_num_running {self.num_running}\n"
        )
        root = self.model_root if self.ready else ""
        return InfoReply(
            query_id,
            self.ready,
            root,
            self.model_name,
            self.max_model_len,
            self.vocab_size,
            self.block_size,
            self.num_kv_blocks,
            metrics,
            self.scheduling_policy,
        )

    def _refusal(self, msg: SubmitRequest) -> tuple[str, str] | None:
        if not self.ready:
            return ErrorKind.UNAVAILABLE, "no worker is ready"
        problem = msg.params.validate()
        if problem is not None:
            return ErrorKind.INVALID_REQUEST, problem
        if msg.priority != 0 and self.scheduling_policy != "priority":
            problem = f"Got priority {msg.priority} but Priority scheduling is not enabled."
            return ErrorKind.INVALID_REQUEST, problem
        if not msg.prompt_token_ids:
            return ErrorKind.INVALID_REQUEST, "the prompt is empty"
        if any(not 0 <= t < self.vocab_size for t in msg.prompt_token_ids):
            return ErrorKind.INVALID_REQUEST, f"token ids must be in [0, {self.vocab_size})"
        total = len(msg.prompt_token_ids) + msg.params.max_tokens
        if total > self.max_model_len:
            return ErrorKind.INVALID_REQUEST, f"prompt + max_tokens = {total} > {self.max_model_len}"
        if -(-total // self.block_size) > self.num_kv_blocks:
            return ErrorKind.INVALID_REQUEST, "the request does not fit in the KV cache"
        return None

    async def _submit(self, identity: bytes, msg: SubmitRequest) -> None:
        refusal = self._refusal(msg)
        if refusal is not None:
            await self._send(identity, RequestError(msg.request_id, *refusal))
            return
        prompt = list(msg.prompt_token_ids)
        key = (msg.cache_salt, tuple(prompt))
        cached = (len(prompt) - 1) // self.block_size * self.block_size if key in self._seen_prompts else 0
        self._seen_prompts.add(key)
        for i in range(msg.params.n):
            seq = FakeSequence(identity, msg.request_id, i, prompt, msg.params, cached, self.output_start)
            # then a stop token (EOS; token 0 without one), as a real model ends: the client drops its text
            seq.script = (*self.scripted, *(self.eos_token_ids[:1] or (0,))) if self.scripted else ()
            self._active.append(seq)
        self._work.set()

    def _output(self, seq: FakeSequence, tokens: list[int], finish_reason: str | None) -> SeqOutput:
        k = seq.params.logprobs
        logprobs = None
        if k is not None:
            first = len(seq.generated) - len(tokens)
            logprobs = [fake_logprobs(t, first + j, k, self.vocab_size) for j, t in enumerate(tokens)]
        return SeqOutput(
            seq.request_id, seq.index, tokens, logprobs, finish_reason, len(seq.prompt), seq.num_cached_tokens
        )

    def _advance(self, seq: FakeSequence) -> SeqOutput:
        token = seq.next_token()
        seq.generated.append(token)
        finish_reason = None
        if token in seq.params.stop_token_ids or (token in self.eos_token_ids and not seq.params.ignore_eos):
            finish_reason = FinishReason.STOP
        elif seq.script and len(seq.generated) >= len(seq.script):
            finish_reason = FinishReason.STOP
        elif len(seq.generated) >= seq.params.max_tokens:
            finish_reason = FinishReason.LENGTH
        seq.finished = finish_reason is not None
        return self._output(seq, [token], finish_reason)

    async def _abort(self, identity: bytes, msg: AbortRequest) -> None:
        for seq in self._active:
            if seq.identity != identity or seq.request_id != msg.request_id or seq.finished:
                continue
            if msg.index is not None and seq.index != msg.index:
                continue
            outputs = []
            for _ in range(self.late_tokens_after_abort):
                token = seq.next_token()
                seq.generated.append(token)
                outputs.append(self._output(seq, [token], None))
            seq.finished = True
            outputs.append(self._output(seq, [], msg.finish_reason))
            await self._send(identity, RequestOutputs(outputs))

    async def _step_loop(self) -> None:
        while True:
            self._active = [s for s in self._active if not s.finished]
            if not self._active:
                self._work.clear()
                await self._work.wait()
                continue
            by_client: dict[bytes, list[SeqOutput]] = {}
            for seq in self._active:
                if not seq.finished:
                    by_client.setdefault(seq.identity, []).append(self._advance(seq))
            for identity, outputs in by_client.items():
                await self._send(identity, RequestOutputs(outputs))
            await asyncio.sleep(self.step_delay)


def kv_snapshot_reply(snapshot: KVSnapshot | None, msg: KVSnapshotRequest) -> KVSnapshot:
    if snapshot is None:
        return empty_snapshot(msg.query_id)
    return msgspec.structs.replace(snapshot, query_id=msg.query_id)
