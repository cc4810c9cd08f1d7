"""A chat choice's output as a list of blocks (reasoning, text, tool calls), whole or as it streams: what
the Responses API calls output items and Anthropic's Messages API content blocks. Both endpoints translate
chat's message and stream deltas (api/chat_output.py) through this, then name the blocks their own way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

BlockKind = Literal["reasoning", "text", "tool_call"]
Step = tuple[Literal["open", "delta", "close"], "Block", str]  # what happened, to which block, the new text


@dataclass
class Block:
    kind: BlockKind
    index: int  # its position in the output
    text: str = ""  # the reasoning or text, or a tool call's arguments (JSON text)
    call_id: str = ""  # a tool call's
    name: str = ""  # a tool call's function


def message_blocks(message: dict[str, Any]) -> list[Block]:
    """The blocks of a non-streamed chat message: its reasoning, its content, then its tool calls."""
    blocks: list[Block] = []
    if message.get("reasoning"):
        blocks.append(Block("reasoning", len(blocks), message["reasoning"]))
    if message.get("content"):
        blocks.append(Block("text", len(blocks), message["content"]))
    for call in message.get("tool_calls") or []:
        function = call["function"]
        blocks.append(Block("tool_call", len(blocks), function["arguments"], call["id"], function["name"]))
    return blocks


class StreamedBlocks:
    """Chat stream deltas as steps on blocks: a block opens when its first text comes, and closes when
    another opens or the stream ends; a tool call's argument fragments extend its block."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.current: Block | None = None
        self._calls: dict[int, Block] = {}  # chat's tool call index -> its block

    def _open(self, steps: list[Step], kind: BlockKind, call_id: str = "", name: str = "") -> Block:
        steps.extend(self.close())
        block = Block(kind, len(self.blocks), call_id=call_id, name=name)
        self.blocks.append(block)
        self.current = block
        steps.append(("open", block, ""))
        return block

    def _extend(self, steps: list[Step], block: Block, text: str) -> None:
        if text:
            block.text += text
            steps.append(("delta", block, text))

    def feed(self, fields: dict[str, Any]) -> list[Step]:
        """The steps of one chat delta's fields (reasoning, content, tool_calls)."""
        steps: list[Step] = []
        for kind, key in (("reasoning", "reasoning"), ("text", "content")):
            text = fields.get(key)
            if text:
                block = self.current
                if block is None or block.kind != kind:
                    block = self._open(steps, kind)  # type: ignore[arg-type]
                self._extend(steps, block, text)
        for entry in fields.get("tool_calls") or []:
            function = entry.get("function") or {}
            block = self._calls.get(entry["index"])
            if block is None:
                block = self._open(steps, "tool_call", entry.get("id") or "", function.get("name") or "")
                self._calls[entry["index"]] = block
            self._extend(steps, block, function.get("arguments") or "")
        return steps

    def open_text(self) -> list[Step]:
        """Opens an empty text block (an output with no blocks still answers with one)."""
        steps: list[Step] = []
        self._open(steps, "text")
        return steps

    def close(self) -> list[Step]:
        """Closes the open block, if any (at the end of the stream)."""
        if self.current is None:
            return []
        block, self.current = self.current, None
        return [("close", block, "")]


def blocks_message(blocks: list[Block]) -> dict[str, Any]:
    """The blocks as the chat assistant message that a follow-up request's history holds."""
    texts = [b.text for b in blocks if b.kind == "text"]
    reasoning = [b.text for b in blocks if b.kind == "reasoning"]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    calls = [b for b in blocks if b.kind == "tool_call"]
    if calls:
        message["tool_calls"] = [
            {"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
            for b in calls
        ]
    return message
