"""Mistral: `[TOOL_CALLS]` then the calls, in either of the two forms Mistral's tokenizers use: a JSON array
of `{"name": ..., "arguments": {...}}` (tokenizer versions before v11), or `name[ARGS]{...}` with one
`[TOOL_CALLS]` per call (v11 and later). The content is the text before the first `[TOOL_CALLS]`; ids are
Mistral's 9-character ids, which its chat template checks.

`[TOOL_CALLS]` is a special token in Mistral's tokenizers: the text reaches this parser only while special
tokens are kept in the output (vLLM turns skip_special_tokens off for this parser; see docs/tool-calling.md).
"""

from __future__ import annotations

from typing import Any

from pagedserve.api.tool_parsers.base import (
    CallState,
    ObjectSequence,
    ToolParser,
    held_prefix,
    mistral_tool_call_id,
)
from pagedserve.api.tool_parsers.json_scan import ValueScan, skip_space

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"  # some v11+ models write `name[CALL_ID]id[ARGS]{...}`: the id is replaced with ours


class MistralToolParser(ToolParser):
    name = "mistral"
    reads_special_tokens = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("make_id", mistral_tool_call_id)
        super().__init__(*args, **kwargs)
        self._first: int | None = None
        self._searched = 0
        self._form = ""  # "json" or "named", once the first call's first character is seen
        self._sequence: ObjectSequence | None = None
        self._pos = 0  # named form: where the next [TOOL_CALLS] is expected

    def _scan(self, final: bool) -> int:
        text = self.text
        if self._first is None:
            found = text.find(BOT, max(0, self._searched - len(BOT)))
            self._searched = len(text)
            if found < 0:
                return len(text) if final else len(text) - held_prefix(text, BOT)
            self._first = found
            self._pos = found
        if not self._form:
            i = skip_space(text, self._first + len(BOT))
            if i >= len(text):
                return self._first
            self._form = "json" if text[i] in "[{" else "named"
            if self._form == "json":
                start = i + 1 if text[i] == "[" else i
                self._sequence = ObjectSequence(start, separator=",")
        if self._sequence is not None:
            self._sequence.advance(self, final)
        else:
            self._scan_named(final)
        return self._first

    def _scan_named(self, final: bool) -> None:
        text = self.text
        while True:
            if self.calls and not self.calls[-1].complete:
                scan = self.calls[-1].args()
                assert scan is not None
                end = scan.advance(text, final)
                if end is None:
                    return
                self._pos = end
            i = skip_space(text, self._pos)
            if not text.startswith(BOT, i):
                return
            args_at = text.find(ARGS, i + len(BOT))
            if args_at < 0:
                return
            name = text[i + len(BOT) : args_at].split(CALL_ID, 1)[0].strip()
            start = skip_space(text, args_at + len(ARGS))
            if start >= len(text):
                return
            self.calls.append(CallState(self.make_id(), name=name, args=ValueScan(start)))
