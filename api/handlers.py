"""POST /v1/completions and /v1/chat/completions: parse, submit, then answer in one body or as a stream.

The steps are shared with the endpoints translated onto chat (api/responses/, api/messages/): read_body,
parse_request, submitted (the requests' lifetime), stream_events (any API's events, with the same
handling of clients that stop reading).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from functools import partial
from typing import Any, Protocol

from aiohttp import web

from pagedserve.api.auth import request_cache_salt
from pagedserve.api.chat_output import ParsedChatFormat
from pagedserve.api.errors import ApiError, error_body, invalid, unavailable
from pagedserve.api.generation import Generation, Usage
from pagedserve.api.model import ServedModel
from pagedserve.api.openai_format import CompletionFormat, ResponseFormat
from pagedserve.api.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    IGNORED_FIELDS,
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from pagedserve.api.request_body import parse_json
from pagedserve.api.request_fields import REFUSED_FIELDS, accept_fields
from pagedserve.api.request_id import request_id
from pagedserve.api.scoring import PromptEcho
from pagedserve.api.state import RECORD, STATE
from pagedserve.client import ClientClosed, RequestRejected, SequenceDelta
from pagedserve.common.config import ApiConfig
from pagedserve.common.log import get_logger
from pagedserve.common.messages import ErrorKind

log = get_logger(component="api.handlers")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
# Bodies up to this size are parsed (and tokenized) on the event loop, in well under a millisecond or
# two; larger ones in the tokenizer thread, so that they neither block the loop nor queue small requests
# behind them.
INLINE_PARSE_BYTES = 16 * 1024
BODY_BYTES = web.RequestKey("body_bytes", int)  # the size of the request's body, as read
STALLED_GRACE_S = 1.0  # how long a stalled stream's error event and [DONE] may take before we hang up


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    """One server-sent event holding `obj` as JSON."""
    return f"data: {dumps(obj)}\n\n".encode()


def check_model(body: Any, model: ServedModel) -> None:
    """Refuses a request for a model we do not serve; an omitted model means the served one."""
    name = body.get("model") if isinstance(body, dict) else None
    if name is None:
        return
    if not isinstance(name, str):
        raise invalid("'model' must be a string", "model")
    if name != model.name:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


def check_answer_size(req: GenerationRequest, cap: int) -> None:
    """Refuses a non-stream request whose answer could hold more than `cap` tokens (each sampled token with
    its top logprobs, and the prompt's tokens with prompt_logprobs): a stream is bounded by what its
    client leaves unread (max_buffered_tokens), a body is held whole until it is sent."""
    total = 0
    for prompt, params in zip(req.prompts, req.params, strict=True):
        total += params.n * params.max_tokens * (1 + (params.logprobs or 0))
        if params.prompt_logprobs is not None:
            total += len(prompt) * (1 + params.prompt_logprobs)
    if total > cap:
        raise invalid(
            f"the answer could hold {total} tokens (n x max_tokens x (1 + logprobs), with the prompt's "
            f"logprobs, summed over prompts), more than the {cap} a non-stream answer may hold: ask for a "
            "stream, fewer tokens or fewer logprobs",
            "max_tokens",
        )


def needs_thread(body: Any) -> bool:
    """A request's own chat template waits for a child process (api/chat_template.py): never on the loop."""
    return isinstance(body, dict) and body.get("chat_template") is not None


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion, CompletionFormat, "cmpl-", COMPLETION_FIELDS)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    parse = partial(parse_chat, config=request.app[STATE].config)
    return await _serve(request, parse, ParsedChatFormat, "chatcmpl-", CHAT_FIELDS)


async def read_body(
    request: web.Request, fields: frozenset[str], refused: Mapping[str, str] = REFUSED_FIELDS
) -> tuple[Any, dict[str, str]]:
    """The request's JSON body screened to `fields` (api/request_fields.py; `refused`: the known fields
    refused with a reason), and the headers that say what was ignored; 503 while draining."""
    state = request.app[STATE]
    if state.draining:
        raise unavailable("the server is shutting down")
    raw = await request.read()  # aiohttp refuses bodies over client_max_size with 413
    request[BODY_BYTES] = len(raw)

    def screened() -> tuple[Any, dict[str, str]]:
        return accept_fields(request, parse_json(raw), fields, refused)

    if len(raw) <= INLINE_PARSE_BYTES:
        return screened()
    # an 8 MB body is millions of objects: parsed on the loop, it would stall every client, /health included
    return await asyncio.get_running_loop().run_in_executor(state.tokenizer_pool, screened)


async def parse_request(
    request: web.Request, parse: Callable[[Any, ServedModel, int], GenerationRequest], body: Any
) -> GenerationRequest:
    """`parse(body)` on the event loop for small bodies, else in the tokenizer pool; a non-stream request
    whose answer could exceed max_response_tokens is refused (check_answer_size)."""
    state = request.app[STATE]
    model = await state.models.get()
    max_seqs = state.config.max_seqs_per_request
    if request.get(BODY_BYTES, 0) <= INLINE_PARSE_BYTES and not needs_thread(body):
        req = parse(body, model, max_seqs)
    else:
        loop = asyncio.get_running_loop()
        req = await loop.run_in_executor(state.tokenizer_pool, parse, body, model, max_seqs)
    if not req.stream:
        check_answer_size(req, state.config.max_response_tokens)
    return req


@contextlib.asynccontextmanager
async def submitted(
    request: web.Request, req: GenerationRequest, id_prefix: str, unique_id: bool = False
) -> AsyncIterator[Generation]:
    """Submits the request's prompts and yields their Generation; on the way out (normal ends, errors, and
    cancellation when the client went away) aborts what has not finished, so the scheduler frees the KV.
    Refusals and a lost scheduler become ApiErrors. The response id ends with the X-Request-Id (given or
    made up: api/request_id.py), or with a fresh one when it must be unique (a stored response's)."""
    state = request.app[STATE]
    response_id = id_prefix + (uuid.uuid4().hex if unique_id else request_id(request))
    record = request[RECORD]
    record.update(
        response_id=response_id,
        stream=req.stream,
        num_prompts=len(req.prompts),
        n=req.params[0].n,
        priority=req.priority,
    )
    handles = []
    try:
        for prompt, params in zip(req.prompts, req.params, strict=True):
            handle = await state.client.submit_one(
                prompt, params, priority=req.priority, cache_salt=request_cache_salt(request, req.cache_salt)
            )
            handles.append(handle)
    except BaseException as e:  # refused, or cancelled because the client left: stop what was submitted
        for handle in handles:
            handle.abort()
        if isinstance(e, RequestRejected):
            raise ApiError.from_rejection(e) from None
        raise
    record["request_ids"] = [h.request_id for h in handles]
    generation = Generation(handles)
    generation.response_id = response_id
    state.in_flight.add(generation)
    try:
        yield generation
    except RequestRejected as e:
        raise ApiError.from_rejection(e) from None
    except ClientClosed as e:  # the scheduler connection is gone
        raise unavailable(str(e)) from None
    finally:
        generation.close()
        state.in_flight.discard(generation)
        usage = generation.usage
        record.update(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
        )


async def _serve(
    request: web.Request,
    parse: Callable[[Any, ServedModel, int], GenerationRequest],
    format_cls: type[ResponseFormat],
    id_prefix: str,
    fields: frozenset[str],
) -> web.StreamResponse:
    body, headers = await read_body(request, fields | IGNORED_FIELDS)
    model = await request.app[STATE].models.get()
    check_model(body, model)
    req = await parse_request(request, parse, body)
    async with submitted(request, req, id_prefix) as generation:
        echo = PromptEcho(req.outputs, generation.handles, model)
        fmt = format_cls(
            generation.response_id,
            model,
            logprobs=req.num_logprobs is not None,
            include_usage_field=req.include_usage,
            echo=echo,
        )
        if isinstance(fmt, ParsedChatFormat):
            fmt.chat_output = req.chat_output
        if req.stream:
            events = OpenAIEvents(fmt, req.include_usage)
            return await stream_events(request, generation, events, request.app[STATE].config, headers)
        choices = await generation.collect()
        body = dumps(fmt.response(choices, generation.usage))
        return web.Response(text=body, content_type="application/json", headers=headers)


class StreamEvents(Protocol):
    """What one API writes on its event stream: OpenAI's chunks, the Responses API's or Anthropic's events."""

    def start(self) -> bytes: ...  # before the first delta's events

    def delta(self, index: int, delta: SequenceDelta) -> bytes: ...  # b"": nothing to send

    def end(self, usage: Usage) -> bytes: ...

    def error(self, message: str, kind: str, code: str | None = None) -> bytes: ...  # ends the stream


class OpenAIEvents:
    """Chat and completion chunks, the usage chunk, `data: [DONE]`."""

    def __init__(self, fmt: ResponseFormat, include_usage: bool) -> None:
        self.fmt = fmt
        self.include_usage = include_usage

    def start(self) -> bytes:
        return b""

    def delta(self, index: int, delta: SequenceDelta) -> bytes:
        chunk = self.fmt.chunk(index, delta)
        return sse(chunk) if chunk is not None else b""

    def end(self, usage: Usage) -> bytes:
        return (sse(self.fmt.usage_chunk(usage)) if self.include_usage else b"") + SSE_DONE

    def error(self, message: str, kind: str, code: str | None = None) -> bytes:
        return sse(error_body(message, kind, code=code)) + SSE_DONE


async def stream_events(
    request: web.Request,
    generation: Generation,
    out: StreamEvents,
    config: ApiConfig,
    headers: dict[str, str],
) -> web.StreamResponse:
    """Writes the events as they come. A client that takes nothing for stream_write_timeout_s, or leaves
    more than max_buffered_tokens unread, has its request aborted and its stream ended (see _end_stalled)."""
    events = generation.stream()
    # Wait for the first delta before sending headers, so that a refusal still gets its HTTP status.
    pending = await anext(events, None)
    response = web.StreamResponse(headers={**SSE_HEADERS, **headers})
    await response.prepare(request)
    if started := out.start():
        await response.write(started)
    loop = asyncio.get_running_loop()
    stalled = "write_timeout"
    writing = True

    async def write(data: bytes) -> None:
        guard.reschedule(loop.time() + config.stream_write_timeout_s)
        await response.write(data)
        guard.reschedule(None)

    def overflow() -> None:
        nonlocal stalled
        if writing:
            stalled = "buffer_full"
            generation.close()  # aborted now: nothing more is queued for it while the handler unwinds
            guard.reschedule(loop.time())  # ends whatever the handler awaits now

    generation.limit_buffer(config.max_buffered_tokens, overflow)
    try:
        async with asyncio.timeout(None) as guard:
            try:
                while pending is not None:
                    if data := out.delta(*pending):
                        await write(data)
                    pending = await anext(events, None)
                await write(out.end(generation.usage))
            except (RequestRejected, ClientClosed) as e:  # too late for a status: report it in the stream
                kind = e.kind if isinstance(e, RequestRejected) else ErrorKind.UNAVAILABLE
                message = e.message if isinstance(e, RequestRejected) else str(e)
                request[RECORD]["error"] = message
                await write(out.error(message, kind))
            finally:
                writing = False
    except TimeoutError:
        await _end_stalled(request, response, generation, stalled, config, out)
    except ConnectionResetError:
        request[RECORD]["outcome"] = "client_disconnected"
    return response


async def _end_stalled(
    request: web.Request,
    response: web.StreamResponse,
    generation: Generation,
    reason: str,
    config: ApiConfig,
    out: StreamEvents,
) -> None:
    """Aborts a stream's requests (the scheduler frees their KV now), then ends the stream with an error
    event and [DONE] if the client takes them within STALLED_GRACE_S, else closes the connection."""
    generation.close()
    if reason == "buffer_full":
        message = f"the client left more than {config.max_buffered_tokens} tokens unread"
    else:
        message = f"the client took no data for {config.stream_write_timeout_s} s"
    record = request[RECORD]
    record.update(outcome="stream_stalled", error=message)
    log.warning("stream_aborted", reason=reason, response_id=record.get("response_id"), error=message)
    try:
        async with asyncio.timeout(min(STALLED_GRACE_S, config.stream_write_timeout_s)):
            await response.write(out.error(message, ErrorKind.INVALID_REQUEST, code="stream_stalled"))
    except (TimeoutError, ConnectionResetError):
        if request.transport is not None:
            request.transport.abort()  # what the client did not take is dropped: nothing waits for it
