"""A chat choice's text read the way the request asks: reasoning (--reasoning-parser) apart from content,
and tool calls (--tool-call-parser with tool_choice `auto`, or the JSON of `required` and a named function)
parsed from the content, in the non-streamed message and in stream deltas alike.

`ParsedChatFormat` is ChatFormat with one `ChoiceReader` per choice; without parsers it is ChatFormat.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagedserve.api.generation import Choice
from pagedserve.api.openai_format import ChatFormat
from pagedserve.api.reasoning import REASONING_PARSERS, ReasoningParser
from pagedserve.api.tool_parsers import ToolParser
from pagedserve.api.tools import ToolOptions
from pagedserve.client import SequenceDelta
from pagedserve.common.config import ApiConfig


@dataclass(frozen=True)
class ChatOutput:
    """How one request's choices are read."""

    tools: ToolOptions
    config: ApiConfig
    prompt_opens_reasoning: bool = False  # the rendered prompt ends inside an open <think>

    @property
    def parses(self) -> bool:
        return bool(self.config.reasoning_parser) or self.tools.choice != "none"

    def reader(self) -> ChoiceReader:
        reasoning = None
        # A forced call's JSON, like any constraint's output, comes after the thinking (parse_chat).
        if self.config.reasoning_parser:
            parser_cls = REASONING_PARSERS[self.config.reasoning_parser]
            reasoning = parser_cls(prompt_opens_reasoning=self.prompt_opens_reasoning)
        return ChoiceReader(reasoning, self.tools.parser(self.config), self.tools)


class ChoiceReader:
    """One choice: its text split into reasoning, content and tool calls, whole or delta by delta."""

    def __init__(
        self, reasoning: ReasoningParser | None, tools: ToolParser | None, options: ToolOptions
    ) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.options = options
        self.called = False  # tool calls were found

    def message(self, text: str) -> dict[str, Any]:
        """The non-streamed response's message."""
        reasoning, content = self.reasoning.extract(text) if self.reasoning else (None, text)
        calls = []
        if self.tools is not None and content is not None:
            content, calls = self.tools.extract(content)
        if not self.options.parallel:
            calls = calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            message["reasoning"] = reasoning
        if calls:
            self.called = True
            message["tool_calls"] = [c.to_json() for c in calls]
        return message

    def delta(self, text: str, final: bool) -> dict[str, Any]:
        """A stream delta's fields (content, reasoning, tool_calls) for `text`, the choice's new text."""
        reasoning, content = "", text
        if self.reasoning is not None:
            split = self.reasoning.feed(text, final)
            reasoning, content = split.reasoning, split.content
        entries: list[dict[str, Any]] = []
        if self.tools is not None:
            found = self.tools.feed(content, final)
            content, entries = found.content, found.tool_calls
            if not self.options.parallel:
                entries = [e for e in entries if e["index"] == 0]
        fields: dict[str, Any] = {}
        if reasoning:
            fields["reasoning"] = reasoning
        if content:
            fields["content"] = content
        if entries:
            self.called = True
            fields["tool_calls"] = entries
        return fields

    def finish_reason(self, reason: str | None) -> str | None:
        """ "tool_calls" for a choice that stopped after calling tools it chose (`auto`, `required`); a named
        function's call ends with "stop", as OpenAI's do."""
        if reason == "stop" and self.called and self.options.choice in ("auto", "required"):
            return "tool_calls"
        return reason


class ParsedChatFormat(ChatFormat):
    """ChatFormat whose choices go through a ChoiceReader when the request has parsers (`chat_output`)."""

    chat_output: ChatOutput | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._readers: dict[int, ChoiceReader] = {}

    def _reader(self, index: int) -> ChoiceReader | None:
        if self.chat_output is None or not self.chat_output.parses:
            return None
        if index not in self._readers:
            self._readers[index] = self.chat_output.reader()
        return self._readers[index]

    def choice(self, c: Choice) -> dict[str, Any]:
        body = super().choice(c)
        reader = self._reader(c.index)
        if reader is not None:
            body["message"] = reader.message(c.text)
            body["finish_reason"] = reader.finish_reason(c.finish_reason)
        return body

    def chunk_choice(self, index: int, delta: SequenceDelta, first: bool) -> dict[str, Any] | None:
        reader = self._reader(index)
        if reader is None:
            return super().chunk_choice(index, delta, first)
        fields = reader.delta(delta.text or "", final=delta.finish_reason is not None)
        body = super().chunk_choice(index, dataclasses.replace(delta, text=""), first)
        if body is None:
            if not fields:
                return None
            body = {"index": index, "delta": {}, "logprobs": None, "finish_reason": None, "stop_reason": None}
        if first:
            body["delta"] = {"role": "assistant", **(fields or {"content": ""})}
        else:
            body["delta"] = fields
        body["finish_reason"] = reader.finish_reason(delta.finish_reason)
        return body
