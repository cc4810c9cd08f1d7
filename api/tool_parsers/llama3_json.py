"""Llama 3.1/3.2 JSON tool calls: the whole output is `{"name": ..., "parameters": {...}}` (optionally after
`<|python_tag|>`, when special tokens are kept), several separated by `;`, as vLLM's `llama3_json` parser
reads them. An output that starts with anything else is content.
"""

from __future__ import annotations

from pagedserve.api.tool_parsers.base import ObjectSequence, ToolParser, held_prefix
from pagedserve.api.tool_parsers.json_scan import skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._is_content: bool | None = None  # decided at the first character that is not whitespace
        self._sequence: ObjectSequence | None = None

    def _scan(self, final: bool) -> int:
        text = self.text
        if self._is_content is None:
            i = skip_space(text, 0)
            if text.startswith(PYTHON_TAG, i):
                i = skip_space(text, i + len(PYTHON_TAG))
            elif i < len(text) and held_prefix(text, PYTHON_TAG) == len(text) - i and not final:
                return 0  # may be the tag
            if i >= len(text):
                if not final:
                    return 0
                self._is_content = True
            else:
                self._is_content = text[i] != "{"
                if not self._is_content:
                    self._sequence = ObjectSequence(i, separator=";")
        if self._is_content:
            return len(text)
        assert self._sequence is not None
        self._sequence.advance(self, final)
        return 0
