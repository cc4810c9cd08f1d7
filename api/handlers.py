"""POST /v1/completions and /v1/chat/completions: parse, submit, then answer in one body or as a stream."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

from aiohttp import web

from pagedserve.api.auth import request_cache_salt
from pagedserve.api.chat_output import ParsedChatFormat
from pagedserve.api.errors import ApiError, error_body, invalid, unavailable
from pagedserve.api.generation import Generation
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
from pagedserve.api.request_fields import accept_fields
from pagedserve.api.request_id import request_id
from pagedserve.api.scoring import PromptEcho
from pagedserve.api.state import RECORD, STATE
from pagedserve.client import ClientClosed, RequestRejected
from pagedserve.common.config import ApiConfig
from pagedserve.common.log import get_logger
from pagedserve.common.messages import ErrorKind

log = get_logger(component="api.handlers")
T = TypeVar("T")

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
# Bodies up to this size are parsed (and tokenized) on the event loop, in well under a millisecond or
# two; larger ones in the tokenizer pool, so that they neither block the loop nor queue small requests
# behind them.
INLINE_PARSE_BYTES = 16 * 1024
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


# A body's fields screened (request_fields.py): the body to parse, and headers saying what was ignored
Screen = Callable[[Any], tuple[Any, dict[str, str]]]


async def parse_body(
    request: web.Request, model: ServedModel, work: Callable[[Any], T], screen: Screen
) -> tuple[T, dict[str, str]]:
    """`work` applied to the request's JSON body (request_body.py's strict parse) once `screen` has taken
    out its unknown fields and check_model has passed, with `screen`'s headers. A small body is parsed on the
    event loop; a large one (or one with its own chat template) in the tokenizer pool, where the body is
    also dropped: an 8 MB body is millions of objects, and parsing or freeing them on the loop would stall
    every other client, /health included."""
    pool = request.app[STATE].tokenizer_pool
    raw = await request.read()  # aiohttp refuses bodies over client_max_size with 413
    if len(raw) > INLINE_PARSE_BYTES:
        return await asyncio.get_running_loop().run_in_executor(pool, _parsed, raw, model, work, screen)
    body, headers = screen(parse_json(raw))
    check_model(body, model)
    if not needs_thread(body):
        return work(body), headers
    return await asyncio.get_running_loop().run_in_executor(pool, work, body), headers


def _parsed(
    raw: bytes, model: ServedModel, work: Callable[[Any], T], screen: Screen
) -> tuple[T, dict[str, str]]:
    body: Any = None
    try:
        body, headers = screen(parse_json(raw))
        check_model(body, model)
        return work(body), headers
    except ApiError as e:
        error = e.with_traceback(None)  # its frames would keep the body alive until the loop drops it
    body = None
    raise error


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


async def _serve(
    request: web.Request,
    parse: Callable[[Any, ServedModel, int], GenerationRequest],
    format_cls: type[ResponseFormat],
    id_prefix: str,
    fields: frozenset[str],
) -> web.StreamResponse:
    state = request.app[STATE]
    if state.draining:
        raise unavailable("the server is shutting down")
    model = await state.models.get()
    max_seqs = state.config.max_seqs_per_request
    req, headers = await parse_body(
        request,
        model,
        lambda body: parse(body, model, max_seqs),
        lambda body: accept_fields(request, body, fields | IGNORED_FIELDS),
    )
    if not req.stream:
        check_answer_size(req, state.config.max_response_tokens)
    response_id = id_prefix + request_id(request)  # X-Request-Id, given or made up (api/request_id.py)
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
    state.in_flight.add(generation)
    echo = PromptEcho(req.outputs, handles, model)
    fmt = format_cls(
        response_id,
        model,
        logprobs=req.num_logprobs is not None,
        include_usage_field=req.include_usage,
        echo=echo,
    )
    if isinstance(fmt, ParsedChatFormat):
        fmt.chat_output = req.chat_output
    try:
        if req.stream:
            return await _stream(request, generation, fmt, req.include_usage, state.config, headers)
        choices = await generation.collect()
        body = dumps(fmt.response(choices, generation.usage))
        return web.Response(text=body, content_type="application/json", headers=headers)
    except RequestRejected as e:
        raise ApiError.from_rejection(e) from None
    except ClientClosed as e:  # the scheduler connection is gone
        raise unavailable(str(e)) from None
    finally:
        # Runs on normal ends, errors and cancellation (the client went away): the scheduler frees the KV.
        generation.close()
        state.in_flight.discard(generation)
        usage = generation.usage
        record.update(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
        )


async def _stream(
    request: web.Request,
    generation: Generation,
    fmt: ResponseFormat,
    include_usage: bool,
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
                    chunk = fmt.chunk(*pending)
                    if chunk is not None:
                        await write(sse(chunk))
                    pending = await anext(events, None)
                if include_usage:
                    await write(sse(fmt.usage_chunk(generation.usage)))
                await write(SSE_DONE)
            except (RequestRejected, ClientClosed) as e:  # too late for a status: report it in the stream
                kind = e.kind if isinstance(e, RequestRejected) else ErrorKind.UNAVAILABLE
                message = e.message if isinstance(e, RequestRejected) else str(e)
                request[RECORD]["error"] = message
                await write(sse(error_body(message, kind)))
                await write(SSE_DONE)
            finally:
                writing = False
    except TimeoutError:
        await _end_stalled(request, response, generation, stalled, config)
    except ConnectionResetError:
        request[RECORD]["outcome"] = "client_disconnected"
    return response


async def _end_stalled(
    request: web.Request, response: web.StreamResponse, generation: Generation, reason: str, config: ApiConfig
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
            await response.write(sse(error_body(message, ErrorKind.INVALID_REQUEST, code="stream_stalled")))
            await response.write(SSE_DONE)
    except (TimeoutError, ConnectionResetError):
        if request.transport is not None:
            request.transport.abort()  # what the client did not take is dropped: nothing waits for it
