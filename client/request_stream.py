"""What a submitted request streams back: per-sequence deltas, the finished results, and the client-side
state of one request that turns the scheduler's outputs into deltas (detokenized, stop strings applied).

`client` re-exports the public names; a handle comes from `AsyncEngineClient.submit`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pagedserve.client.detokenizer import SequenceText
from pagedserve.client.scored_prompt import ScoredPrompt
from pagedserve.common.messages import AbortRequest, FinishReason, SamplingParams, SeqOutput, TokenLogprobs


@dataclass
class SequenceDelta:
    """What one sequence of a request produced since its previous delta."""

    request_id: str
    index: int  # which of the request's n sequences
    token_ids: list[int]  # new tokens (those after a stop string included: they were generated)
    text: str | None  # new final text; None when the client has no tokenizer
    logprobs: list[TokenLogprobs] | None  # one per new token when the request asked for logprobs
    finish_reason: str | None  # set on the sequence's last delta
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens the scheduler served from its prefix cache
    num_output_tokens: int  # tokens this sequence has generated so far, these included
    stop_string: str | None = None  # on the last delta of a sequence that a stop string ended: that string


@dataclass
class SequenceResult:
    """One finished sequence."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None


@dataclass
class RequestResult:
    """One finished request: its n sequences and usage counters."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[SequenceResult]
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: ScoredPrompt | None = None  # when the request asked for prompt_logprobs

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)


_END = None  # queued after a request's last delta


class _RequestState:
    """Client-side state of one request; touched only by the event loop's thread.

    Deltas wait in `queue` until the handle's reader takes them. By default nothing bounds that queue (a
    ZeroMQ client reads as fast as it likes); a server that forwards deltas to a slower peer sets a bound
    with `RequestHandle.limit_buffer` and is told once when it is passed.
    """

    def __init__(self, request_id: str, prompt: list[int], params: SamplingParams, tokenizer: Any) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.params = params
        self.queue: asyncio.Queue[SequenceDelta | BaseException | None] = asyncio.Queue()
        n = params.n
        self.texts = None if tokenizer is None else [_sequence_text(tokenizer, params) for _ in range(n)]
        self.prompt_logprobs = None if params.prompt_logprobs is None else ScoredPrompt()
        self.num_output_tokens = [0] * n
        self.finished = [False] * n
        self.num_unfinished = n
        self.num_cached_tokens = 0
        self.num_buffered_tokens = 0  # tokens in queued deltas not yet taken (an empty delta counts as one)
        self.max_buffered_tokens: int | None = None  # None: unbounded
        self.on_overflow: Callable[[], None] | None = None  # called once, soon, when the bound is passed
        self.interrupted: BaseException | None = None  # raised to the reader ahead of anything queued

    def _put(self, delta: SequenceDelta) -> None:
        self.queue.put_nowait(delta)
        self.num_buffered_tokens += max(1, len(delta.token_ids))
        limit = self.max_buffered_tokens
        if limit is not None and self.num_buffered_tokens > limit and self.on_overflow is not None:
            callback, self.on_overflow = self.on_overflow, None
            # Not called here: we are inside the client's dispatch, which must not see the request aborted
            asyncio.get_running_loop().call_soon(callback)

    @property
    def done(self) -> bool:
        return self.num_unfinished == 0

    def _finish(self, index: int) -> None:
        self.finished[index] = True
        self.num_unfinished -= 1
        if self.num_unfinished == 0:
            self.queue.put_nowait(_END)

    def on_output(self, out: SeqOutput) -> AbortRequest | None:
        """Queues the delta for `out`; returns the abort to send when a stop string ended the sequence."""
        i = out.index
        if not 0 <= i < len(self.finished) or self.finished[i]:
            return None  # late tokens of a sequence we already ended
        if out.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.add(out.prompt_logprobs)
        if not out.token_ids and out.finish_reason is None:
            return None  # prompt logprobs alone: no delta (they are all in before any token is)
        self.num_output_tokens[i] += len(out.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        finish_reason = out.finish_reason
        text = None
        stop_string = None
        if self.texts is not None:
            seq_text = self.texts[i]
            # A stop token's text is left out, as a stop string's, unless include_stop_str_in_output
            drop_stop = finish_reason == FinishReason.STOP and not self.params.include_stop_str_in_output
            text = seq_text.push(out.token_ids[:-1] if drop_stop else out.token_ids)
            if finish_reason is not None and not seq_text.stopped:
                text += seq_text.finish()
            if seq_text.stopped:
                finish_reason = FinishReason.STOP
                stop_string = seq_text.stop_string
        self._put(
            SequenceDelta(
                self.request_id,
                i,
                list(out.token_ids),
                text,
                out.logprobs,
                finish_reason,
                out.num_prompt_tokens,
                self.num_cached_tokens,
                self.num_output_tokens[i],
                stop_string,
            )
        )
        if finish_reason is None:
            return None
        self._finish(i)
        if out.finish_reason is None:  # ended here by a stop string; the scheduler must stop it too
            return AbortRequest(self.request_id, i, FinishReason.STOP)
        return None

    def abort_locally(self) -> None:
        """Ends every unfinished sequence with finish_reason "abort", flushing its held-back text."""
        for i, finished in enumerate(self.finished):
            if finished:
                continue
            text = None if self.texts is None else self.texts[i].finish()
            self._put(
                SequenceDelta(
                    self.request_id,
                    i,
                    [],
                    text,
                    None,
                    FinishReason.ABORT,
                    len(self.prompt_token_ids),
                    self.num_cached_tokens,
                    self.num_output_tokens[i],
                )
            )
            self._finish(i)

    def fail(self, error: BaseException) -> None:
        self.num_unfinished = 0
        self.queue.put_nowait(error)


class RequestHandle:
    """One submitted prompt. `async for delta in handle` streams its deltas; `await handle.result()` waits.

    Made by the client, which passes its `abort(request_id)` for `handle.abort()` to call.
    """

    def __init__(self, state: _RequestState, abort: Callable[[str], None]) -> None:
        self._state = state
        self._abort = abort
        self._exhausted = False
        self.request_id = state.request_id
        self.prompt_token_ids = state.prompt_token_ids
        self.params = state.params

    @property
    def finished(self) -> bool:
        """Every sequence has ended (or the request failed); nothing more will be queued."""
        return self._state.done

    @property
    def prompt_logprobs(self) -> ScoredPrompt | None:
        """The prompt's logprobs received so far (None when the request asked for none): complete by the
        time any sequence's first delta is read, since the scheduler sends them all before any token."""
        return self._state.prompt_logprobs

    def __aiter__(self) -> AsyncIterator[SequenceDelta]:
        return self

    async def __anext__(self) -> SequenceDelta:
        if self._exhausted:
            raise StopAsyncIteration
        state = self._state
        item = state.interrupted
        if item is None:
            item = await state.queue.get()
        if state.interrupted is not None:
            item = state.interrupted
        if isinstance(item, SequenceDelta):
            state.num_buffered_tokens -= max(1, len(item.token_ids))
            return item
        self._exhausted = True
        if item is _END:
            raise StopAsyncIteration
        raise item

    def abort(self) -> None:
        """Stops the request at the scheduler; unfinished sequences end with finish_reason "abort"."""
        self._abort(self.request_id)

    @property
    def num_buffered_tokens(self) -> int:
        """Tokens received for this request and not yet taken by its reader."""
        return self._state.num_buffered_tokens

    def limit_buffer(self, max_tokens: int, on_overflow: Callable[[], None]) -> None:
        """Calls `on_overflow` once (soon, from the event loop) when more than `max_tokens` tokens wait
        unread; what to do about it (abort, usually) is the caller's choice. By default nothing is bounded."""
        self._state.max_buffered_tokens = max_tokens
        self._state.on_overflow = on_overflow

    def interrupt(self, error: BaseException) -> None:
        """Aborts the request and makes its reader raise `error` next, ahead of any deltas still queued."""
        self._state.interrupted = error
        self._state.queue.put_nowait(error)  # wakes a reader waiting on the queue
        self.abort()

    async def result(self) -> RequestResult:
        """Consumes the remaining deltas and returns the finished request. Raises RequestRejected."""
        want_logprobs = self.params.logprobs is not None
        outputs = [SequenceResult(i, logprobs=[] if want_logprobs else None) for i in range(self.params.n)]
        num_prompt_tokens = len(self.prompt_token_ids)
        num_cached_tokens = 0
        async for delta in self:
            seq = outputs[delta.index]
            seq.token_ids.extend(delta.token_ids)
            if delta.text is not None:
                seq.text = (seq.text or "") + delta.text
            if delta.logprobs and seq.logprobs is not None:
                seq.logprobs.extend(delta.logprobs)
            seq.finish_reason = delta.finish_reason or seq.finish_reason
            num_prompt_tokens = delta.num_prompt_tokens
            num_cached_tokens = max(num_cached_tokens, delta.num_cached_tokens)
        return RequestResult(
            self.request_id,
            self.prompt_token_ids,
            outputs,
            num_prompt_tokens,
            num_cached_tokens,
            self.prompt_logprobs,
        )


def _sequence_text(tokenizer: Any, params: SamplingParams) -> SequenceText:
    return SequenceText(
        tokenizer,
        params.stop,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
        include_stop_str=params.include_stop_str_in_output,
        min_tokens=params.min_tokens,
    )
