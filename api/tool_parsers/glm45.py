"""GLM-4.5 / 4.6: each call a block of the function's name then key/value pairs, the values untyped text
(typed by the tools' schemas, typed_values.py); the text before the first block is the content:

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 writes no newline after the name; both read the same.) Blocks after the first count wherever they
are, as with hermes. A call streams its name once the first `<arg_key>` or `</tool_call>` follows it, and each
argument when its `</arg_value>` arrives; a block that breaks the form is not a call.
"""

from __future__ import annotations

from pagedserve.api.tool_parsers.base import CallState
from pagedserve.api.tool_parsers.json_scan import skip_space
from pagedserve.api.tool_parsers.qwen3_coder import TaggedBlocksParser, at_tag
from pagedserve.api.tool_parsers.typed_values import parameter_schemas, typed_value

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END = "<arg_key>", "</arg_key>"
VALUE, VALUE_END = "<arg_value>", "</arg_value>"


class Glm45ToolParser(TaggedBlocksParser):
    # _state: find, name, body
    name = "glm45"
    reads_special_tokens = True  # the tags are special tokens in GLM's tokenizer

    def _step(self, text: str, final: bool) -> bool:
        """One element of a block; False when the text must grow first (or the blocks ended)."""
        if self._state == "find":
            found = text.find(START, self._pos)
            if found < 0:
                return False
            self._pos, self._state = found + len(START), "name"
            return True
        if self._state == "name":
            ends = [e for e in (text.find(KEY, self._pos), text.find(END, self._pos)) if e >= 0]
            if not ends:
                return False
            name = text[self._pos : min(ends)].strip()
            if not name or "<" in name:
                self._broken = True
                return False
            self.calls.append(CallState(self.make_id(), name=name))
            self._pos, self._state = min(ends), "body"
            return True
        i = skip_space(text, self._pos)
        call = self.calls[-1]
        if at_tag(text, i, END, final):
            call.close()
            self._pos, self._state = i + len(END), "find"
            return True
        tag = at_tag(text, i, KEY, final)
        if tag is False and at_tag(text, i, END, final) is False:
            self._broken = True
        key_end = text.find(KEY_END, i) if tag else -1
        value_at = skip_space(text, key_end + len(KEY_END)) if key_end >= 0 else -1
        if value_at < 0 or at_tag(text, value_at, VALUE, final) is not True:
            self._broken = self._broken or (value_at >= 0 and at_tag(text, value_at, VALUE, final) is False)
            return False
        # a long value arrives over many deltas: search only what is new
        end = text.find(VALUE_END, max(value_at, self._searched - len(VALUE_END)))
        if end < 0:
            self._searched = len(text)
            return False
        self._searched = 0
        key = text[i + len(KEY) : key_end].strip()
        schema = parameter_schemas(self.tools, call.name(text) or "").get(key)
        call.add_argument(key, typed_value(text[value_at + len(VALUE) : end], schema))
        self._pos = end + len(VALUE_END)
        return True
