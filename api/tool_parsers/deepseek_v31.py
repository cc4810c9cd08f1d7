"""DeepSeek V3.1: the calls in one section, each the function's name then its arguments' JSON; the text
before the section is the content:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(with no newline between calls in the real output). The markers are special tokens, read only while they
are kept in the text. The arguments stream as the model writes them.
"""

from __future__ import annotations

from typing import Any

from pagedserve.api.tool_parsers.base import CallState, ToolParser, held_prefix
from pagedserve.api.tool_parsers.json_scan import ValueScan, skip_space
from pagedserve.api.tool_parsers.qwen3_coder import at_tag

BEGIN = "<｜tool▁calls▁begin｜>"
CALL, SEP, CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"


class SectionToolParser(ToolParser):
    """Calls in a section that opens with one of BEGINS: per call CALL, a header up to SEP (`_call` reads the
    name from it), SEP, the arguments' JSON, CALL_END; the text before the section is the content."""

    reads_special_tokens = True
    BEGINS: tuple[str, ...] = (BEGIN,)  # the section's opening marker (a family may have two spellings)
    CALL, SEP, CALL_END = CALL, SEP, CALL_END

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._first: int | None = None
        self._pos = 0
        self._after_call = False  # the last call's arguments ended: its CALL_END comes next
        self._searched = 0  # how far the text was searched for the section

    def _call(self, header: str) -> CallState:
        return CallState(self.make_id(), name=header.strip())

    def _scan(self, final: bool) -> int:
        text = self.text
        if self._first is None:
            since = max(0, self._searched - max(len(b) for b in self.BEGINS))  # one pass over the content
            found = min(((i, b) for b in self.BEGINS if (i := text.find(b, since)) >= 0), default=None)
            self._searched = len(text)
            if found is None:
                return len(text) if final else len(text) - max(held_prefix(text, b) for b in self.BEGINS)
            self._first, self._pos = found[0], found[0] + len(found[1])
        while True:
            if self.calls and not self.calls[-1].complete:
                scan = self.calls[-1].args()
                assert scan is not None
                end = scan.advance(text, final)
                if end is None:
                    return self._first
                self._pos, self._after_call = end, True
            if self._after_call:
                i = skip_space(text, self._pos)
                if not at_tag(text, i, self.CALL_END, final):
                    return self._first  # the end marker is still coming (or the section broke off)
                self._pos, self._after_call = i + len(self.CALL_END), False
            i = skip_space(text, self._pos)
            if not text.startswith(self.CALL, i):
                return self._first
            sep = text.find(self.SEP, i + len(self.CALL))
            start = skip_space(text, sep + len(self.SEP)) if sep >= 0 else len(text)
            if start >= len(text):
                return self._first
            call = self._call(text[i + len(self.CALL) : sep])
            call._args = ValueScan(start)
            self.calls.append(call)


class DeepSeekV31ToolParser(SectionToolParser):
    name = "deepseek_v31"
