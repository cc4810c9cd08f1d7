"""The blocking client: an AsyncEngineClient on an event loop in a background thread, for plain threads.

with EngineClient("tcp://127.0.0.1:5570") as client:
    [result] = client.generate("Hello", SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Iterator, Sequence
from typing import Any, TypeVar

from pagedserve.client.async_client import AsyncEngineClient, Prompt
from pagedserve.client.request_stream import RequestHandle, RequestResult, SequenceDelta
from pagedserve.common.messages import InfoReply, SamplingParams

T = TypeVar("T")


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
