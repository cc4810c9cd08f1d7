"""What routers ask a replica besides the OpenAI routes (vllm-router, llm-d's and Dynamo's KV routers):

POST /v1/completions/render       vLLM's answer: a list, one entry per prompt, of {request_id, token_ids,
POST /v1/chat/completions/render  features, sampling_params, model, stream, cache_salt, priority,
                                  kv_transfer_params}; the chat route answers one such object. The body is
                                  the generation request itself, parsed and refused (400) exactly as the
                                  generation route would, so `token_ids` are the ids that route would feed
                                  the model: what a KV-aware router matches against the replica's events.
GET /kv_event_sources             vLLM's discovery answer: a JSON array of {data_parallel_rank, endpoint,
                                  replay_endpoint, topic} (empty while events are off).
GET /get_server_info              SGLang's name for its flat settings object: the served model, its limits,
                                  this replica's data-parallel rank and its KV-events config.

All need the API key when one is set (server.py); none submits anything to the scheduler.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import msgspec
from aiohttp import web

from pagedserve.api.auth import request_cache_salt
from pagedserve.api.handlers import check_model, dumps, parse_request, read_body
from pagedserve.api.model import ServedModel
from pagedserve.api.protocol import (
    CHAT_FIELDS,
    COMPLETION_FIELDS,
    IGNORED_FIELDS,
    GenerationRequest,
    parse_chat,
    parse_completion,
)
from pagedserve.api.request_id import request_id
from pagedserve.api.state import STATE
from pagedserve.api.version import server_version
from pagedserve.common.config import ApiConfig
from pagedserve.common.kv_events_config import endpoint_for_rank, parse_kv_events_config
from pagedserve.common.sampling_params import SamplingParams

Parse = Callable[[Any, ServedModel, int], GenerationRequest]


def _sampling_params(params: SamplingParams) -> dict[str, Any]:
    """The parameters by name (ours are sent positionally on the wire; a router reads names)."""
    return {f: msgspec.to_builtins(getattr(params, f)) for f in params.__struct_fields__ if f != "structured"}


def render_entries(
    req: GenerationRequest, model: ServedModel, response_id: str, cache_salt: str
) -> list[dict[str, Any]]:
    """One vLLM `GenerateRequest` per prompt of `req`; `cache_salt` is the one its blocks would be cached
    (and announced in KV events) under: the request's own within its API key's (api/auth.py)."""
    return [
        {
            "request_id": response_id if len(req.prompts) == 1 else f"{response_id}-{i}",
            "token_ids": list(prompt),
            "features": None,  # text only: no multimodal inputs
            "sampling_params": _sampling_params(params),
            "model": model.name,
            "stream": req.stream,
            "cache_salt": cache_salt or None,
            "priority": req.priority,
            "kv_transfer_params": None,
        }
        for i, (prompt, params) in enumerate(zip(req.prompts, req.params, strict=True))
    ]


async def _render(request: web.Request, parse: Parse, fields: frozenset[str], id_prefix: str) -> Any:
    """The request's prompts as its generation route would submit them: the same body screening, model
    check and parse (a large body off the event loop), so the same 400s."""
    body, headers = await read_body(request, fields | IGNORED_FIELDS)
    model = await request.app[STATE].models.get()
    check_model(body, model)
    req = await parse_request(request, parse, body)
    salt = request_cache_salt(request, req.cache_salt)
    entries = render_entries(req, model, id_prefix + request_id(request), salt)
    return entries, headers


async def render_completion(request: web.Request) -> web.Response:
    entries, headers = await _render(request, parse_completion, COMPLETION_FIELDS, "cmpl-")
    return web.Response(text=dumps(entries), content_type="application/json", headers=headers)


async def render_chat(request: web.Request) -> web.Response:
    parse = partial(parse_chat, config=request.app[STATE].config)
    (entry,), headers = await _render(request, parse, CHAT_FIELDS, "chatcmpl-")
    return web.Response(text=dumps(entry), content_type="application/json", headers=headers)


def kv_event_sources(config: ApiConfig) -> list[dict[str, Any]]:
    """Where this replica's scheduler publishes, offset by its rank as the scheduler offsets them."""
    events = parse_kv_events_config(config.kv_events_config)
    if events is None or events.resolved_publisher != "zmq":
        return []
    rank = config.data_parallel_rank
    replay = events.replay_endpoint
    return [
        {
            "data_parallel_rank": rank,
            "endpoint": endpoint_for_rank(events.endpoint, rank),
            "replay_endpoint": endpoint_for_rank(replay, rank) if replay else None,
            "topic": events.topic,
        }
    ]


async def get_kv_event_sources(request: web.Request) -> web.Response:
    sources = kv_event_sources(request.app[STATE].config)
    return web.Response(text=dumps(sources), content_type="application/json")


async def get_server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = await state.models.get()
    info = {
        "model_path": model.root,
        "served_model_name": model.name,
        "context_length": model.max_model_len,
        "max_total_num_tokens": model.kv_capacity_tokens,
        "dp_size": 1,  # each replica is its own engine; the router spreads over replicas
        "data_parallel_rank": state.config.data_parallel_rank,
        "kv_events_config": state.config.kv_events_config or None,
        "kv_event_sources": kv_event_sources(state.config),
        "version": server_version(),
        "engine": "pagedserve",
    }
    return web.Response(text=dumps(info), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions/render", render_completion)
    app.router.add_post("/v1/chat/completions/render", render_chat)
    app.router.add_get("/kv_event_sources", get_kv_event_sources)
    app.router.add_get("/get_server_info", get_server_info)
