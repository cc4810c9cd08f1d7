"""POST /v1/messages and /v1/messages/count_tokens: the body translated to chat (request.py), generated
(or only rendered and counted) as a chat request is, answered in Anthropic's shapes (output.py)."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

from aiohttp import web

from pagedserve.api.chat import render_chat_request
from pagedserve.api.chat_output import ParsedChatFormat
from pagedserve.api.handlers import check_model, dumps, parse_request, read_body, stream_events, submitted
from pagedserve.api.messages.output import MessageEvents, message
from pagedserve.api.messages.request import COUNT_TOKENS_FIELDS, MESSAGES_FIELDS, MESSAGES_REFUSED, chat_body
from pagedserve.api.model import ServedModel
from pagedserve.api.output_blocks import message_blocks
from pagedserve.api.protocol import parse_chat
from pagedserve.api.state import STATE
from pagedserve.api.tools import parse_tools
from pagedserve.common.config import ApiConfig

PATH = "/v1/messages"


def is_messages_path(path: str) -> bool:
    """Whether a request's errors take Anthropic's shape."""
    return path == PATH or path.startswith(PATH + "/")


async def create_message(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    body, headers = await read_body(request, MESSAGES_FIELDS, MESSAGES_REFUSED)
    model = await state.models.get()
    check_model(body, model)
    chat = chat_body(body)
    req = await parse_request(request, partial(parse_chat, config=state.config), chat)
    async with submitted(request, req, "msg_", unique_id=True) as generation:
        fmt = ParsedChatFormat(generation.response_id, model, logprobs=False)
        fmt.chat_output = req.chat_output
        if req.stream:
            events = MessageEvents(fmt, generation.response_id, model.name, generation.usage)
            return await stream_events(request, generation, events, state.config, headers)
        choices = await generation.collect()
        [choice] = fmt.response(choices, generation.usage)["choices"]
        blocks = message_blocks(choice["message"])
        answer = message(
            generation.response_id, model.name, blocks, choice["finish_reason"], choice["stop_reason"],
            generation.usage,
        )  # fmt: skip
        return web.Response(text=dumps(answer), content_type="application/json", headers=headers)


def _count(body: Any, model: ServedModel, config: ApiConfig) -> int:
    chat = chat_body(body, counting=True)
    if chat.get("tools"):
        chat["tool_choice"] = "none"  # the template renders the tools alike whatever the choice
    return len(render_chat_request(chat, model, config, parse_tools(chat, config)).token_ids)


async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens, as the chat template renders the messages, system and tools."""
    state = request.app[STATE]
    body, headers = await read_body(request, COUNT_TOKENS_FIELDS, MESSAGES_REFUSED)
    model = await state.models.get()
    check_model(body, model)
    loop = asyncio.get_running_loop()
    num_tokens = await loop.run_in_executor(state.tokenizer_pool, _count, body, model, state.config)
    return web.Response(
        text=dumps({"input_tokens": num_tokens}), content_type="application/json", headers=headers
    )


def add_routes(app: web.Application) -> None:
    app.router.add_post(PATH, create_message)
    app.router.add_post(PATH + "/count_tokens", count_tokens)


__all__ = ["add_routes", "is_messages_path"]
