"""Anthropic's Message object, its event stream, and its error body, from a chat choice's blocks
(api/output_blocks.py): reasoning -> a `thinking` block, text -> `text`, a tool call -> `tool_use` with its
arguments as the `input` object.

Streamed: `message_start`, `ping`, then per block `content_block_start`, `content_block_delta`
(`thinking_delta`, `text_delta` or `input_json_delta`) ..., `content_block_stop`; then `message_delta`
(stop_reason, stop_sequence, usage) and `message_stop`. Each is an `event: <type>` / `data: <json>` pair.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pagedserve.api.chat_output import ParsedChatFormat
from pagedserve.api.errors import STATUS_BY_KIND, ApiError
from pagedserve.api.generation import Usage
from pagedserve.api.output_blocks import Block, Step, StreamedBlocks

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_response(e: ApiError) -> web.Response:
    """An ApiError in Anthropic's shape, with the same status and headers."""
    return web.json_response(error_body(e.status, e.message), status=e.status, headers=e.headers)


def stop_reason(finish_reason: str | None, stop: Any, blocks: list[Block]) -> tuple[str | None, str | None]:
    """Anthropic's (stop_reason, stop_sequence) for a chat choice's finish."""
    if finish_reason == "length":
        return "max_tokens", None
    if any(b.kind == "tool_call" for b in blocks):
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage_json(usage: Usage) -> dict[str, Any]:
    """Anthropic counts prompt tokens read from the cache apart from input_tokens."""
    return {
        "input_tokens": usage.prompt_tokens - usage.cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def _input(arguments: str) -> Any:
    try:
        value = json.loads(arguments) if arguments else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_block(block: Block, streaming: bool = False) -> dict[str, Any]:
    """A block as Anthropic writes it; `streaming`: as content_block_start opens it, empty."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": "" if streaming else block.text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": "" if streaming else block.text}
    return {
        "type": "tool_use",
        "id": block.call_id,
        "name": block.name,
        "input": {} if streaming else _input(block.text),
    }


def message(
    message_id: str, model_name: str, blocks: list[Block], finish_reason: str | None, stop: Any, usage: Usage
) -> dict[str, Any]:
    reason, sequence = stop_reason(finish_reason, stop, blocks)
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model_name,
        "content": [content_block(b) for b in blocks],
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage_json(usage),
    }


def _event(kind: str, **fields: Any) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields}, ensure_ascii=False)}\n\n".encode()


DELTA_TYPES = {"reasoning": ("thinking_delta", "thinking"), "text": ("text_delta", "text")}


class MessageEvents:
    """One message's event stream (handlers.StreamEvents), read from chat's stream chunks."""

    def __init__(self, fmt: ParsedChatFormat, message_id: str, model_name: str, usage: Usage) -> None:
        self.fmt = fmt
        self.message_id = message_id
        self.model_name = model_name
        self.usage = usage  # the generation's, counted as it goes
        self.blocks = StreamedBlocks()
        self.finish_reason: str | None = None
        self.stop: Any = None

    def start(self) -> bytes:
        empty = message(self.message_id, self.model_name, [], None, None, self.usage)
        empty["stop_reason"] = None
        return _event("message_start", message=empty) + _event("ping")

    def _step(self, step: Step) -> bytes:
        what, block, text = step
        if what == "open":
            return _event("content_block_start", index=block.index, content_block=content_block(block, True))
        if what == "close":
            return _event("content_block_stop", index=block.index)
        if block.kind == "tool_call":
            delta = {"type": "input_json_delta", "partial_json": text}
        else:
            kind, key = DELTA_TYPES[block.kind]
            delta = {"type": kind, key: text}
        return _event("content_block_delta", index=block.index, delta=delta)

    def delta(self, index: int, delta: Any) -> bytes:
        chunk = self.fmt.chunk(index, delta)
        if chunk is None:
            return b""
        choice = chunk["choices"][0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        self.stop = choice.get("stop_reason") or self.stop
        return b"".join(self._step(s) for s in self.blocks.feed(choice["delta"]))

    def end(self, usage: Usage) -> bytes:
        out = b"".join(self._step(s) for s in self.blocks.close())
        reason, sequence = stop_reason(self.finish_reason, self.stop, self.blocks.blocks)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        out += _event("message_delta", delta=delta, usage=usage_json(usage))
        return out + _event("message_stop")

    def error(self, message: str, kind: str, code: str | None = None) -> bytes:
        return _event("error", error=error_body(STATUS_BY_KIND.get(kind, 500), message)["error"])
