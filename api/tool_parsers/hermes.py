"""Hermes and Qwen 2.5/3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one block per call.

The content is the text before the first block (vLLM's `hermes` parser). Later blocks count wherever they
are, as vLLM finds every block in the text: text between or after blocks is dropped. An unclosed last block
at the end of the text still counts, as in vLLM; a malformed one makes the whole text content.
"""

from __future__ import annotations

from pagedserve.api.tool_parsers.base import ObjectSequence, ToolParser, held_prefix

START = "<tool_call>"
END = "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    reads_special_tokens = True

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._first: int | None = None  # where the first START is
        self._searched = 0
        self._sequence: ObjectSequence | None = None
        self._resumed = 0  # how far the text after the last block was searched for another one

    def _scan(self, final: bool) -> int:
        text = self.text
        if self._first is None:
            found = text.find(START, max(0, self._searched - len(START)))
            self._searched = len(text)
            if found < 0:
                return len(text) if final else len(text) - held_prefix(text, START)
            self._first = found
            self._sequence = ObjectSequence(found, START, END)
        while True:
            sequence = self._sequence
            assert sequence is not None
            sequence.advance(self, final)
            if not sequence.ended or sequence.failed:
                return self._first
            # The text went on with something else after a whole block: a later block still counts.
            found = text.find(START, max(sequence.pos, self._resumed - len(START)))
            if found < 0:
                self._resumed = len(text)
                return self._first
            self._sequence = ObjectSequence(found, START, END)
