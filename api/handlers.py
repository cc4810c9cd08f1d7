"""POST /v1/completions and /v1/chat/completions: parse, submit, then answer in one body or as a stream."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from aiohttp import web

from api.errors import ApiError, error_body, invalid
from api.generation import Generation
from api.model import ServedModel
from api.openai_format import ChatFormat, CompletionFormat, ResponseFormat
from api.protocol import GenerationRequest, parse_chat, parse_completion
from api.state import RECORD, STATE
from common.client import ClientClosed, RequestRejected
from common.messages import ErrorKind

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(obj: Any) -> bytes:
    """One server-sent event holding `obj` as JSON."""
    return f"data: {dumps(obj)}\n\n".encode()


async def read_json(request: web.Request) -> Any:
    raw = await request.read()  # aiohttp refuses bodies over client_max_size with 413
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise invalid(f"the body is not valid JSON: {e}") from None


def check_model(body: Any, model: ServedModel) -> None:
    """Refuses a request for a model we do not serve; an omitted model means the served one."""
    name = body.get("model") if isinstance(body, dict) else None
    if name is None:
        return
    if not isinstance(name, str):
        raise invalid("'model' must be a string", "model")
    if name != model.name:
        raise ApiError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion, CompletionFormat, "cmpl-")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_chat, ChatFormat, "chatcmpl-")


async def _serve(
    request: web.Request,
    parse: Callable[[Any, ServedModel], GenerationRequest],
    format_cls: type[ResponseFormat],
    id_prefix: str,
) -> web.StreamResponse:
    state = request.app[STATE]
    body = await read_json(request)
    model = await state.models.get()
    check_model(body, model)
    req = parse(body, model)
    response_id = id_prefix + uuid.uuid4().hex
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
                prompt, params, priority=req.priority, cache_salt=req.cache_salt
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
    fmt = format_cls(
        response_id, model, logprobs=req.num_logprobs is not None, include_usage_field=req.include_usage
    )
    try:
        if req.stream:
            return await _stream(request, generation, fmt, req.include_usage)
        choices = await generation.collect()
        return web.Response(
            text=dumps(fmt.response(choices, generation.usage)), content_type="application/json"
        )
    except RequestRejected as e:
        raise ApiError.from_rejection(e) from None
    finally:
        # Runs on normal ends, errors and cancellation (the client went away): the scheduler frees the KV.
        generation.close()
        usage = generation.usage
        record.update(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            cached_tokens=usage.cached_tokens,
        )


async def _stream(
    request: web.Request, generation: Generation, fmt: ResponseFormat, include_usage: bool
) -> web.StreamResponse:
    events = generation.stream()
    # Wait for the first delta before sending headers, so that a refusal still gets its HTTP status.
    pending = await anext(events, None)
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)
    try:
        while pending is not None:
            chunk = fmt.chunk(*pending)
            if chunk is not None:
                await response.write(sse(chunk))
            pending = await anext(events, None)
        if include_usage:
            await response.write(sse(fmt.usage_chunk(generation.usage)))
        await response.write(SSE_DONE)
    except (RequestRejected, ClientClosed) as e:  # too late for a status: report it inside the stream
        kind = e.kind if isinstance(e, RequestRejected) else ErrorKind.UNAVAILABLE
        await response.write(sse(error_body(str(e), kind)))
        await response.write(SSE_DONE)
    except ConnectionResetError:
        request[RECORD]["outcome"] = "client_disconnected"
    return response
