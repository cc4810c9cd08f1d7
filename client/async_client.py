"""The asyncio client library: submit prompts to the scheduler and stream their outputs back.

`AsyncEngineClient` is the request-level API: prompts are checked and tokenized here, each request's outputs
come back through its RequestHandle, detokenized and checked for stop strings on the way. The socket, the
requests in flight and the watch over the scheduler's health are its SchedulerConnection's
(client/connection.py).

    async with AsyncEngineClient("tcp://127.0.0.1:5570") as client:
        [handle] = await client.submit(["Hello"], SamplingParams(max_tokens=8))
        async for delta in handle:
            print(delta.index, delta.text, delta.finish_reason)
"""

from __future__ import annotations

import asyncio
import itertools
import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pagedserve.client.connection import SchedulerConnection
from pagedserve.client.errors import RequestRejected
from pagedserve.client.request_stream import RequestHandle, RequestResult, _RequestState
from pagedserve.common.config import default_cluster_key_file
from pagedserve.common.log import get_logger
from pagedserve.common.messages import (
    ErrorKind,
    InfoReply,
    KVSnapshot,
    SamplingParams,
    SubmitRequest,
)
from pagedserve.common.wire_types import MAX_INT32, MAX_NAME_CHARS, MAX_PROMPT_TOKENS

Prompt = str | Sequence[int]  # text (tokenized here) or token ids (sent exactly as given)
log = get_logger(component="client")


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
    """Submits requests to the scheduler and streams their outputs; use from one asyncio event loop.

    `tokenizer` is a transformers tokenizer, a checkpoint directory to load one from, or None to load the
    one of the checkpoint the worker serves (InfoReply.model_root) when first needed. Without a tokenizer
    (or with detokenize=False) deltas carry no text, and text prompts and stop strings are refused.
    `cluster_key_file` holds the cluster's CURVE key (None: PAGEDSERVE_CLUSTER_KEY_FILE, else the default).
    Requests in flight fail with UNAVAILABLE when the scheduler exits, or stays silent for
    `liveness_timeout_s` (client/connection.py).
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
        self._connection = SchedulerConnection(
            address,
            cluster_key_file=cluster_key_file or default_cluster_key_file(),
            info_timeout=info_timeout,
            liveness_timeout_s=liveness_timeout_s,
        )
        self._tokenizer_arg = tokenizer
        self._tokenizer: Any = tokenizer if not isinstance(tokenizer, str | Path | None) else None
        self._tokenizer_lock = asyncio.Lock()
        self._tokenizer_failed = False  # the checkpoint the scheduler named could not be loaded here
        self._detokenize = detokenize
        self._id_prefix = uuid.uuid4().hex[:12]
        self._request_counter = itertools.count()

    async def start(self) -> None:
        """Connects the socket and starts the receive task; called by every method, so optional."""
        await self._connection.start()

    async def __aenter__(self) -> AsyncEngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def connected(self) -> bool:
        """Whether the scheduler's connection is up (it may still be hung: see `liveness_timeout_s`)."""
        return self._connection.connected

    @property
    def num_unfinished(self) -> int:
        """Requests submitted through this client that have not finished."""
        return self._connection.num_unfinished

    async def info(self, timeout: float | None = None) -> InfoReply:
        """Asks the scheduler for its state. Raises TimeoutError when it does not answer in time."""
        return await self._connection.info(timeout)

    async def kv_snapshot(self, max_cells: int = 4096, timeout: float | None = None) -> KVSnapshot:
        """A picture of the scheduler's KV pool (what /dashboard shows). Raises TimeoutError."""
        return await self._connection.kv_snapshot(max_cells, timeout)

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
        await self._connection.wait_connected()
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
                states.append(state)
                request = SubmitRequest(state.request_id, prompt, params, priority, cache_salt)
                await self._connection.send_request(state, request)
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
        self._connection.abort(request_id)

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
        await self._connection.close()
