"""The Response object and its stream of events, as the openai SDK reads them (openai/types/responses/).

A chat choice's blocks (api/output_blocks.py) are the response's output items: reasoning -> a `reasoning`
item with `reasoning_text` content, text -> an assistant `message` with one `output_text` part, a tool call
-> a `function_call` item. A choice that ran out of `max_output_tokens` makes an `incomplete` response.

Streamed: `response.created`, `response.in_progress`, then per item `response.output_item.added`,
(`response.content_part.added`, `response.output_text.delta` or `response.reasoning_text.delta` ...,
their `.done`, `response.content_part.done`) or (`response.function_call_arguments.delta` ...,
`.done`), `response.output_item.done`; and `response.completed` (or `response.incomplete`) with the whole
response. Every event has a `sequence_number`, from 0.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from pagedserve.api.chat_output import ParsedChatFormat
from pagedserve.api.generation import Usage
from pagedserve.api.output_blocks import Block, Step, StreamedBlocks

ITEM_PREFIXES = {"reasoning": "rs_", "text": "msg_", "tool_call": "fc_"}


def usage_json(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _part(block: Block) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": block.text}
    return {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """One response's object and items; item ids stay the same from `added` to `completed`."""

    def __init__(self, response_id: str, model_name: str, echo: dict[str, Any]) -> None:
        self.id = response_id
        self.model_name = model_name
        self.echo = echo
        self.created_at = int(time.time())
        self._item_ids: dict[int, str] = {}

    def item_id(self, block: Block) -> str:
        if block.index not in self._item_ids:
            self._item_ids[block.index] = ITEM_PREFIXES[block.kind] + uuid.uuid4().hex
        return self._item_ids[block.index]

    def item(self, block: Block, status: str) -> dict[str, Any]:
        item_id = self.item_id(block)
        done = status != "in_progress"
        if block.kind == "tool_call":
            return {
                "id": item_id,
                "type": "function_call",
                "call_id": block.call_id,
                "name": block.name,
                "arguments": block.text,
                "status": status,
            }
        content = [_part(block)] if done else []
        if block.kind == "reasoning":
            return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
        return {"id": item_id, "type": "message", "role": "assistant", "content": content, "status": status}

    def response(
        self, blocks: list[Block], finish_reason: str | None, usage: Usage | None, status: str = ""
    ) -> dict[str, Any]:
        """The Response object; `status` given (in_progress, failed) or from the finish reason."""
        incomplete = finish_reason == "length"
        status = status or ("incomplete" if incomplete else "completed")
        item_status = "incomplete" if incomplete else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.model_name,
            "output": [self.item(b, item_status) for b in blocks],
            "usage": usage_json(usage) if usage is not None else None,
            **self.echo,
        }


class ResponsesEvents:
    """The stream of one response (handlers.StreamEvents), read from chat's stream chunks."""

    def __init__(
        self,
        fmt: ParsedChatFormat,
        builder: ResponseBuilder,
        on_end: Callable[[list[Block]], None],
    ) -> None:
        self.fmt = fmt
        self.builder = builder
        self.on_end = on_end  # the finished output's blocks (for the store)
        self.blocks = StreamedBlocks()
        self.finish_reason: str | None = None
        self.sequence_number = 0

    def _event(self, kind: str, **fields: Any) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n".encode()

    def _lifecycle(self, kind: str, status: str = "", usage: Usage | None = None) -> bytes:
        response = self.builder.response(self.blocks.blocks, self.finish_reason, usage, status)
        return self._event(kind, response=response)

    def start(self) -> bytes:
        return self._lifecycle("response.created", "in_progress") + self._lifecycle(
            "response.in_progress", "in_progress"
        )

    def _step(self, step: Step) -> bytes:
        what, block, text = step
        b = self.builder
        ids = {"item_id": b.item_id(block), "output_index": block.index}
        if what == "open":
            out = self._event(
                "response.output_item.added", output_index=block.index, item=b.item(block, "in_progress")
            )
            if block.kind != "tool_call":
                empty = {**_part(block), "text": ""}
                out += self._event("response.content_part.added", **ids, content_index=0, part=empty)
            return out
        if what == "delta":
            if block.kind == "tool_call":
                return self._event("response.function_call_arguments.delta", **ids, delta=text)
            if block.kind == "reasoning":
                return self._event("response.reasoning_text.delta", **ids, content_index=0, delta=text)
            return self._event("response.output_text.delta", **ids, content_index=0, delta=text, logprobs=[])
        status = "incomplete" if self.finish_reason == "length" else "completed"
        if block.kind == "tool_call":
            out = self._event(
                "response.function_call_arguments.done", **ids, name=block.name, arguments=block.text
            )
        else:
            if block.kind == "reasoning":
                out = self._event("response.reasoning_text.done", **ids, content_index=0, text=block.text)
            else:
                out = self._event(
                    "response.output_text.done", **ids, content_index=0, text=block.text, logprobs=[]
                )
            out += self._event("response.content_part.done", **ids, content_index=0, part=_part(block))
        return out + self._event(
            "response.output_item.done", output_index=block.index, item=b.item(block, status)
        )

    def delta(self, index: int, delta: Any) -> bytes:
        chunk = self.fmt.chunk(index, delta)
        if chunk is None:
            return b""
        choice = chunk["choices"][0]
        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return b"".join(self._step(s) for s in self.blocks.feed(choice["delta"]))

    def end(self, usage: Usage) -> bytes:
        opened = [] if self.blocks.blocks else self.blocks.open_text()  # an empty answer is an empty message
        out = b"".join(self._step(s) for s in [*opened, *self.blocks.close()])
        self.on_end(self.blocks.blocks)
        kind = "response.incomplete" if self.finish_reason == "length" else "response.completed"
        return out + self._lifecycle(kind, usage=usage)

    def error(self, message: str, kind: str, code: str | None = None) -> bytes:
        out = self._event("error", code=code or kind, message=message, param=None)
        failed = self.builder.response(self.blocks.blocks, self.finish_reason, None, "failed")
        failed["error"] = {"code": "server_error", "message": message}
        return out + self._event("response.failed", response=failed)
