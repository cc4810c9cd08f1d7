"""The scheduler requests behind one HTTP request, seen as one stream of choices, with usage counters."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagedserve.client import RequestHandle, SequenceDelta
from pagedserve.common.messages import TokenLogprobs


@dataclass
class Usage:
    prompt_tokens: int = 0  # each prompt counted once, however many sequences it has
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    def to_json(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass
class Choice:
    """One finished choice of a non-streamed response."""

    index: int
    text_parts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_string: str | None = None  # the stop string that ended it, if one did

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


_DONE = object()  # a pump's handle has no more deltas


class Generation:
    """Merges the deltas of several handles (one per prompt) into (choice index, delta) pairs.

    Choice `p * n + i` is sequence i of prompt p, as in OpenAI's batched completions. `close()` aborts what
    has not finished, so that the scheduler frees its KV blocks when the HTTP client goes away.
    Deltas wait in the handles' queues until taken (the merging queue holds one per prompt at most), so
    `limit_buffer` bounds everything the request holds for its reader.
    """

    def __init__(self, handles: list[RequestHandle]) -> None:
        self.handles = handles
        self.n = handles[0].params.n
        self.usage = Usage(prompt_tokens=sum(len(h.prompt_token_ids) for h in handles))
        self._cached = [0] * len(handles)
        self._pumps: list[asyncio.Task[None]] = []
        self.response_id = ""  # the HTTP response's id (handlers.submitted)

    def _count(self, prompt_index: int, delta: SequenceDelta) -> int:
        self.usage.completion_tokens += len(delta.token_ids)
        self._cached[prompt_index] = max(self._cached[prompt_index], delta.num_cached_tokens)
        self.usage.cached_tokens = sum(self._cached)
        return prompt_index * self.n + delta.index

    async def stream(self) -> AsyncIterator[tuple[int, SequenceDelta]]:
        """Every delta of every sequence, as it comes. Raises RequestRejected when a prompt is refused."""
        if len(self.handles) == 1:  # the common case needs no merging tasks
            async for delta in self.handles[0]:
                yield self._count(0, delta), delta
            return
        # Bounded, so that a pump waits for the reader and unread deltas stay in their handle's queue.
        queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue(maxsize=len(self.handles))

        async def pump(prompt_index: int, handle: RequestHandle) -> None:
            try:
                async for delta in handle:
                    await queue.put((prompt_index, delta))
                await queue.put((prompt_index, _DONE))
            except Exception as e:
                await queue.put((prompt_index, e))

        self._pumps = [asyncio.create_task(pump(p, h)) for p, h in enumerate(self.handles)]
        remaining = len(self.handles)
        while remaining:
            prompt_index, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, SequenceDelta):
                yield self._count(prompt_index, item), item
            else:
                raise item  # type: ignore[misc]

    async def collect(self) -> list[Choice]:
        """Waits for every choice to finish."""
        choices = [Choice(i) for i in range(len(self.handles) * self.n)]
        async for index, delta in self.stream():
            choice = choices[index]
            if delta.text:
                choice.text_parts.append(delta.text)
            choice.token_ids.extend(delta.token_ids)
            choice.logprobs.extend(delta.logprobs or ())
            choice.finish_reason = delta.finish_reason or choice.finish_reason
            choice.stop_string = delta.stop_string or choice.stop_string
        return choices

    def limit_buffer(self, max_tokens: int, on_overflow: Callable[[], None]) -> None:
        """Calls `on_overflow` once when more than `max_tokens` tokens (shared by the prompts) wait unread."""
        called = False

        def once() -> None:
            nonlocal called
            if not called:
                called = True
                on_overflow()

        share = max(1, max_tokens // len(self.handles))
        for handle in self.handles:
            handle.limit_buffer(share, once)

    def interrupt(self, error: BaseException) -> None:
        """Aborts every request; the reader gets `error` (the server is shutting down, say)."""
        for handle in self.handles:
            handle.interrupt(error)

    def close(self) -> None:
        """Aborts every unfinished request (a no-op for finished ones) and stops the merging tasks."""
        for pump in self._pumps:
            pump.cancel()
        for handle in self.handles:
            if not handle.finished:
                handle.abort()
