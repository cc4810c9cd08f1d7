"""Where JSON values, objects and arrays end in a text that grows as tokens stream in.

A tool call's arguments are streamed as the very characters the model wrote (the openai client concatenates
`function.arguments` fragments), so a streaming parser needs to know, at every delta, which characters
belong to a value and whether it has ended; it never needs the parsed value before the end. Every scanner
here resumes where it stopped, so a response costs one pass over its text, not one per delta.
"""

from __future__ import annotations

import json
import re
from typing import Any

_STRING_SPECIAL = re.compile(r'["\\]')
_CONTAINER_SPECIAL = re.compile(r'["{}\[\]]')
_SCALAR_END = re.compile(r"[\s,}\]\[{:\"]")
_NOT_SPACE = re.compile(r"\S")


def skip_space(text: str, i: int) -> int:
    """The index of the first non-whitespace character at or after `i`, or len(text)."""
    m = _NOT_SPACE.search(text, i)
    return m.start() if m else len(text)


class ValueScan:
    """One JSON value starting at `start` (its first character, not whitespace): `advance` says where it
    ends, or None while the text ends inside it. It checks the structure only as far as finding the end
    needs; the parsers json.loads every complete value they use."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end: int | None = None
        self._pos = start
        self._depth = 0
        self._in_string = False
        self._kind = ""  # "string", "container" or "scalar", once the first character is seen

    def advance(self, text: str, final: bool = False) -> int | None:
        """The end (exclusive) of the value in `text`, or None. With `final`, the text will not grow: a
        scalar (a number, say) that runs to the end of it ends there."""
        if self.end is not None:
            return self.end
        if not self._kind:
            if self._pos >= len(text):
                return None
            first = text[self._pos]
            self._kind = "container" if first in "{[" else "string" if first == '"' else "scalar"
        if self._kind == "scalar":
            m = _SCALAR_END.search(text, self._pos)
            if m is not None:
                self.end = m.start()
            elif final:
                self.end = len(text)
            else:
                self._pos = len(text)
            return self.end
        return self._scan_nested(text)

    def _scan_nested(self, text: str) -> int | None:
        i = self._pos
        n = len(text)
        while i < n:
            if self._in_string:
                m = _STRING_SPECIAL.search(text, i)
                if m is None:
                    i = n
                    break
                i = m.start()
                if text[i] == "\\":
                    if i + 1 >= n:  # the escaped character has not come yet
                        break
                    i += 2
                    continue
                self._in_string = False
                i += 1
                if self._kind == "string":
                    self.end = i
                    return i
                continue
            if self._kind == "string":  # the opening quote
                self._in_string = True
                i += 1
                continue
            m = _CONTAINER_SPECIAL.search(text, i)
            if m is None:
                i = n
                break
            i = m.start()
            c = text[i]
            i += 1
            if c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            else:
                self._depth -= 1
                if self._depth == 0:
                    self.end = i
                    return i
        self._pos = i
        return None

    def complete(self, text: str) -> str | None:
        """The value's text once it has ended."""
        return text[self.start : self.end] if self.end is not None else None


class ObjectScan:
    """A JSON object starting at `start` (its "{"): its keys as they complete, each with the ValueScan of
    its value, so that a parser can stream one field's characters before the object closes. `error` is
    set for a text that is not an object; `end` once the closing brace is seen."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.end: int | None = None
        self.error = False
        self.fields: dict[str, ValueScan] = {}
        self._pos = start + 1
        self._state = "key"  # key, colon, value, next
        self._key = ""
        self._key_scan: ValueScan | None = None
        self._value: ValueScan | None = None

    def advance(self, text: str, final: bool = False) -> None:
        while self.end is None and not self.error:
            i = skip_space(text, self._pos)
            if i >= len(text):
                if final:
                    self.error = self._value is None or self._value.advance(text, final) is None
                return
            if self._state == "key":
                if text[i] == "}" and not self.fields and self._key_scan is None:
                    self.end = i + 1
                    return
                if self._key_scan is None:
                    if text[i] != '"':
                        self.error = True
                        return
                    self._key_scan = ValueScan(i)
                end = self._key_scan.advance(text)
                if end is None:
                    return
                self._key = json.loads(text[self._key_scan.start : end])
                self._key_scan = None
                self._pos, self._state = end, "colon"
            elif self._state == "colon":
                if text[i] != ":":
                    self.error = True
                    return
                self._pos, self._state = i + 1, "value"
            elif self._state == "value":
                if self._value is None:
                    self._value = ValueScan(i)
                    self.fields[self._key] = self._value
                end = self._value.advance(text, final)
                if end is None:
                    return
                self._value = None
                self._pos, self._state = end, "next"
            else:  # after a value: "," or "}"
                if text[i] == "}":
                    self.end = i + 1
                elif text[i] == ",":
                    self._pos, self._state = i + 1, "key"
                else:
                    self.error = True

    def value(self, text: str, key: str) -> Any:
        """A complete field's parsed value; None when absent, unfinished or not JSON."""
        scan = self.fields.get(key)
        raw = scan.complete(text) if scan is not None else None
        if raw is None:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return None
