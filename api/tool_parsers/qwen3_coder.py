"""Qwen3-Coder: each call an XML-style block, its values untyped text (typed by the tools' schemas,
typed_values.py); the text before the first block is the content:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The chat template writes one newline after `<parameter=k>` and one before `</parameter>`: they are not part of
the value. Blocks after the first count wherever they are, as with hermes. A call streams its name when
`<function=...>` is complete, and each argument when its `</parameter>` arrives. A block that breaks the
form (or is unclosed at the end) is not a call: the whole text is content when read whole.
"""

from __future__ import annotations

from typing import Any

from pagedserve.api.tool_parsers.base import CallState, ToolParser, held_prefix
from pagedserve.api.tool_parsers.json_scan import skip_space
from pagedserve.api.tool_parsers.typed_values import parameter_schemas, typed_value

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"


def _strip_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def at_tag(text: str, i: int, tag: str, final: bool) -> bool | None:
    """Whether `tag` is at `i`; None while the text ends inside what may still become it."""
    seen = text[i : i + len(tag)]
    if seen == tag:
        return True
    return None if tag.startswith(seen) and not final else False


class TaggedBlocksParser(ToolParser):
    """Calls in `<tool_call>` blocks after the content (Qwen3-Coder's and GLM-4.5's forms): the content ends
    at the first block's start; `_step` reads one element of a block at `_pos` (its `_state` says which),
    returning False when the text must grow first, or setting `_broken` when the form breaks."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._first: int | None = None
        self._pos = 0
        self._state = "find"
        self._broken = False
        self._content_searched = 0  # how far the text was searched for the first block
        self._searched = 0  # how far the text was searched for the current value's end

    def _scan(self, final: bool) -> int:
        text = self.text
        if self._first is None:
            found = text.find(START, max(0, self._content_searched - len(START)))  # one pass over the content
            self._content_searched = len(text)
            if found < 0:
                return len(text) if final else len(text) - held_prefix(text, START)
            self._first = self._pos = found
        while not self._broken and self._step(text, final):
            pass
        return self._first

    def _step(self, text: str, final: bool) -> bool:
        raise NotImplementedError


class Qwen3CoderToolParser(TaggedBlocksParser):
    # _state: find, function, body, close
    name = "qwen3_coder"
    reads_special_tokens = True  # <tool_call> is a special token in Qwen3's tokenizer

    def _step(self, text: str, final: bool) -> bool:
        """One element of a block; False when the text must grow first (or the blocks ended)."""
        if self._state == "find":
            found = text.find(START, self._pos)
            if found < 0:
                return False
            self._pos, self._state = found + len(START), "function"
            return True
        i = skip_space(text, self._pos)
        if self._state == "function":
            tag = at_tag(text, i, FUNCTION, final)
            gt = text.find(">", i) if tag else -1
            if tag is False:
                self._broken = True
            if not tag or gt < 0:
                return False
            self.calls.append(CallState(self.make_id(), name=text[i + len(FUNCTION) : gt].strip()))
            self._pos, self._state = gt + 1, "body"
            return True
        if self._state == "close":
            tag = at_tag(text, i, END, final)
            if tag is False:
                self._broken = True
            if tag:
                self._pos, self._state = i + len(END), "find"
            return bool(tag)
        call = self.calls[-1]
        if at_tag(text, i, FUNCTION_END, final):
            call.close()
            self._pos, self._state = i + len(FUNCTION_END), "close"
            return True
        tag = at_tag(text, i, PARAMETER, final)
        if tag is False and at_tag(text, i, FUNCTION_END, final) is False:
            self._broken = True
        gt = text.find(">", i) if tag else -1
        # a long value (a file's text, say) arrives over many deltas: search only what is new
        end = text.find(PARAMETER_END, max(gt, self._searched - len(PARAMETER_END))) if gt >= 0 else -1
        if end < 0:
            self._searched = len(text) if gt >= 0 else 0
            return False
        self._searched = 0
        key = text[i + len(PARAMETER) : gt].strip()
        schema = parameter_schemas(self.tools, call.name(text) or "").get(key)
        call.add_argument(key, typed_value(_strip_newline(text[gt + 1 : end]), schema))
        self._pos = end + len(PARAMETER_END)
        return True
