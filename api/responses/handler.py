"""POST /v1/responses: the body translated to chat (request.py), generated as a chat request is, the
choice answered as a Response (output.py) and, with `store`, kept for `previous_response_id` (store.py)."""

from __future__ import annotations

from functools import partial
from typing import Any

from aiohttp import web

from pagedserve.api.auth import TENANT
from pagedserve.api.chat_output import ParsedChatFormat
from pagedserve.api.errors import ApiError, invalid
from pagedserve.api.handlers import check_model, dumps, parse_request, read_body, stream_events, submitted
from pagedserve.api.output_blocks import Block, blocks_message, message_blocks
from pagedserve.api.protocol import parse_chat
from pagedserve.api.responses.output import ResponseBuilder, ResponsesEvents
from pagedserve.api.responses.request import RESPONSES_FIELDS, RESPONSES_REFUSED, previous_id, translate
from pagedserve.api.responses.store import ResponseStore
from pagedserve.api.state import STATE

STORE = web.AppKey("responses_store", ResponseStore)


def _owner(request: web.Request) -> str:
    tenant = request.get(TENANT)
    return tenant.name if tenant is not None else ""


async def create_response(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    store = request.app[STORE]
    body, headers = await read_body(request, RESPONSES_FIELDS, RESPONSES_REFUSED)
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    model = await state.models.get()
    check_model(body, model)
    history: list[dict[str, Any]] = []
    if (previous := previous_id(body)) is not None:
        found = store.get(previous, _owner(request))
        if found is None:
            message = f"Previous response with id '{previous}' not found."
            raise ApiError(404, message, param="previous_response_id", code="previous_response_not_found")
        history = found
    asked = translate(body, history)
    req = await parse_request(request, partial(parse_chat, config=state.config), asked.chat_body)

    def keep(blocks: list[Block]) -> None:
        if asked.store:
            store.put(builder.id, _owner(request), [*asked.conversation, blocks_message(blocks)])

    async with submitted(request, req, "resp_", unique_id=True) as generation:
        fmt = ParsedChatFormat(generation.response_id, model, logprobs=False)
        fmt.chat_output = req.chat_output
        builder = ResponseBuilder(generation.response_id, model.name, asked.echo)
        if req.stream:
            events = ResponsesEvents(fmt, builder, keep)
            return await stream_events(request, generation, events, state.config, headers)
        choices = await generation.collect()
        [choice] = fmt.response(choices, generation.usage)["choices"]
        blocks = message_blocks(choice["message"]) or [Block("text", 0)]  # an empty answer: an empty message
        keep(blocks)
        response = builder.response(blocks, choice["finish_reason"], generation.usage)
        return web.Response(text=dumps(response), content_type="application/json", headers=headers)


def add_routes(app: web.Application) -> None:
    config = app[STATE].config
    app[STORE] = ResponseStore(config.responses_store_size, config.responses_store_ttl_s)
    app.router.add_post("/v1/responses", create_response)
