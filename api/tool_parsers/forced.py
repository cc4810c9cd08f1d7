"""Outputs that structured output made tool calls: tool_choice `required` (a JSON array of
`{"name": ..., "parameters": {...}}`, the schema vLLM enforces) and a named function (the output is that
function's arguments object)."""

from __future__ import annotations

from typing import Any

from pagedserve.api.tool_parsers.base import CallState, ObjectSequence, ToolParser
from pagedserve.api.tool_parsers.json_scan import ValueScan, skip_space


class RequiredToolParser(ToolParser):
    name = "required"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._sequence: ObjectSequence | None = None

    def _scan(self, final: bool) -> int:
        if self._sequence is None:
            i = skip_space(self.text, 0)
            if i >= len(self.text) or self.text[i] != "[":
                return len(self.text) if final and i < len(self.text) else 0
            self._sequence = ObjectSequence(i + 1, separator=",")
        self._sequence.advance(self, final)
        return 0


class NamedToolParser(ToolParser):
    name = "named"

    def __init__(self, function_name: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.function_name = function_name

    def _scan(self, final: bool) -> int:
        if not self.calls:
            i = skip_space(self.text, 0)
            if i >= len(self.text):
                return 0
            self.calls.append(CallState(self.make_id(), name=self.function_name, args=ValueScan(i)))
        scan = self.calls[0].args()
        assert scan is not None
        scan.advance(self.text, final)
        return 0
