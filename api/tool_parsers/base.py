"""What every tool-call parser shares: calls found in a growing text, streamed as OpenAI's `delta.tool_calls`.

A parser is made per choice and fed the choice's text as it is generated (`feed`), then told the text is
complete (`finish`). Each call returns a `ToolDelta`: the content that is surely not part of a tool call,
and `delta.tool_calls` entries the way the openai client accumulates them (an entry with the call's index,
id, type and function name once, then `function.arguments` fragments that concatenate to the arguments'
JSON text as the model wrote it). `extract` parses a whole text at once, as vLLM's non-streaming path does:
a text whose calls are not all complete, named and valid JSON is content, with no calls.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pagedserve.api.tool_parsers.json_scan import ObjectScan, ValueScan, skip_space

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Qwen and OpenAI say arguments, Llama 3 parameters


def random_tool_call_id() -> str:
    """vLLM's form of a tool call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_tool_call_id() -> str:
    """Mistral's: 9 letters and digits (its chat template refuses any other)."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(9))


@dataclass(frozen=True)
class ToolCall:
    """A complete call, as the non-streamed response's `message.tool_calls` holds it."""

    id: str
    name: str
    arguments: str  # the arguments object's JSON text

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass
class ToolDelta:
    """What one `feed` adds: content to send, and `delta.tool_calls` entries (at most one per index)."""

    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class CallState:
    """One call in the text: its name (given, or the "name" field of its object) and its arguments (a
    field of its object, or a value of their own), with how much of them has been streamed."""

    def __init__(
        self,
        call_id: str,
        obj: ObjectScan | None = None,
        name: str | None = None,
        args: ValueScan | None = None,
    ) -> None:
        self.id = call_id
        self.obj = obj
        self._name = name
        self._args = args
        self.name_sent = False
        self.args_sent = 0  # characters of the arguments' text streamed
        self.args_done = False
        # Formats whose argument values are untyped text (XML-style): the arguments' JSON text, built by the
        # parser as each value ends (`add_argument`), and whether the call's closing tag was seen
        self.built: str | None = None
        self.closed = False

    def add_argument(self, key: str, value: Any) -> None:
        """One more argument of a built call (its text as json.dumps of the whole object would write it)."""
        head = "{" if not self.built else self.built + ", "
        self.built = head + json.dumps(key, ensure_ascii=False) + ": " + json.dumps(value, ensure_ascii=False)

    def close(self) -> None:
        """A built call's end: its arguments' object is complete."""
        self.built = (self.built + "}") if self.built else "{}"
        self.closed = True

    def name(self, text: str) -> str | None:
        if self._name is not None:
            return self._name
        value = self.obj.value(text, "name") if self.obj is not None else None
        return value if isinstance(value, str) else None

    def args(self) -> ValueScan | None:
        if self._args is not None or self.obj is None:
            return self._args
        return next((self.obj.fields[k] for k in ARGUMENT_KEYS if k in self.obj.fields), None)

    @property
    def complete(self) -> bool:
        if self.closed:
            return True
        if self.obj is not None:
            return self.obj.end is not None
        return self._args is not None and self._args.end is not None

    @property
    def failed(self) -> bool:
        return self.obj is not None and self.obj.error

    def parsed(self, text: str) -> ToolCall | None:
        """The call, if it is complete, named, and its arguments are a JSON object (or absent)."""
        name = self.name(text)
        scan = self.args()
        if not self.complete or self.failed or name is None:
            return None
        if self.built is not None:
            return ToolCall(self.id, name, self.built)
        if scan is None:
            return ToolCall(self.id, name, "{}")
        raw = scan.complete(text)
        try:
            value = json.loads(raw) if raw is not None else None
            if isinstance(value, str):  # arguments written as a JSON string holding the object
                value = json.loads(value)
        except ValueError:
            return None
        if not isinstance(value, dict):
            return None
        return ToolCall(self.id, name, json.dumps(value, ensure_ascii=False))


class ToolParser:
    """Finds tool calls in one choice's text. Subclasses implement `_scan`: advance `self.calls` over
    `self.text` and return how many leading characters are surely content (never fewer than before)."""

    name: ClassVar[str] = ""
    # The call markers are special tokens in real tokenizers (<tool_call>, [TOOL_CALLS]): the text this parser
    # reads must keep them, as vLLM's parsers ask (skip_special_tokens false)
    reads_special_tokens: ClassVar[bool] = False

    def __init__(
        self, make_id: Callable[[], str] = random_tool_call_id, tools: list[dict[str, Any]] | None = None
    ) -> None:
        self.text = ""
        self.calls: list[CallState] = []
        self.make_id = make_id
        self.tools = tools or []  # the request's tools, for formats whose argument values are untyped text
        self._content_sent = 0

    def _scan(self, final: bool) -> int:
        raise NotImplementedError

    def feed(self, delta: str, final: bool = False) -> ToolDelta:
        self.text += delta
        content_end = self._scan(final)
        out = ToolDelta(self.text[self._content_sent : content_end])
        self._content_sent = max(self._content_sent, content_end)
        self._add_call_deltas(out, final)
        return out

    def _add_call_deltas(self, out: ToolDelta, final: bool) -> None:
        for index, call in enumerate(self.calls):
            entry = self._call_delta(index, call, final)
            if entry is not None:
                out.tool_calls.append(entry)
            if not call.name_sent:
                break  # calls stream in order

    def finish(self) -> ToolDelta:
        return self.feed("", final=True)

    @property
    def content_end(self) -> int:
        return self._content_sent

    def _call_delta(self, index: int, call: CallState, final: bool) -> dict[str, Any] | None:
        text = self.text
        function: dict[str, Any] = {}
        entry: dict[str, Any] = {"index": index, "function": function}
        if not call.name_sent:
            name = call.name(text)
            if name is None:
                return None
            call.name_sent = True
            entry.update(id=call.id, type="function")
            function.update(name=name, arguments="")
        if call.args_done:
            return entry if function else None
        scan = call.args()
        piece = ""
        if call.built is not None or call.closed:
            piece = (call.built or "")[call.args_sent :]
            call.args_sent += len(piece)
            call.args_done = call.closed
        elif scan is None:
            if call.complete:
                piece, call.args_done = "{}", True
        elif text.startswith('"', scan.start):  # a JSON string holding the object: sent once decoded
            raw = scan.complete(text)
            if raw is not None:
                try:
                    value = json.loads(raw)
                except ValueError:
                    value = raw
                piece, call.args_done = (value if isinstance(value, str) else raw), True
        else:
            end = scan.advance(text, final)
            stop = end if end is not None else len(text)
            piece = text[scan.start + call.args_sent : stop]
            call.args_sent = stop - scan.start
            call.args_done = end is not None
        if piece:
            function["arguments"] = function.get("arguments", "") + piece
        return entry if function else None

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A whole text's content and calls (content None when it is empty and there are calls). A text
        with a call that is not valid is all content, as vLLM answers it."""
        self.feed(text, final=True)
        calls = [c.parsed(self.text) for c in self.calls]
        if not calls or any(c is None for c in calls):
            return text, []
        content = self._whole_content()
        return (content or None), [c for c in calls if c is not None]

    def _whole_content(self) -> str:
        """The content of the whole text once it has been fed (a prefix of it, unless a format says else)."""
        return self.text[: self._content_sent]


def held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the start of `marker`, and so must wait."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ObjectSequence:
    """Calls written as JSON objects one after another from `pos`: each inside `open_tag` ... `close_tag`
    (when given), separated by whitespace and an optional `separator`. Stops at anything else."""

    def __init__(self, pos: int, open_tag: str = "", close_tag: str = "", separator: str = "") -> None:
        self.pos = pos
        self.open_tag = open_tag
        self.close_tag = close_tag
        self.separator = separator
        self.ended = False  # no more calls: the text went on with something else
        self.failed = False  # ended on a malformed call
        self._state = "open"
        self._current: CallState | None = None

    def advance(self, parser: ToolParser, final: bool) -> None:
        text = parser.text
        while not self.ended:
            if self._state == "object":
                obj = self._current.obj if self._current is not None else None
                assert obj is not None
                obj.advance(text, final)
                if obj.error:
                    self.ended = self.failed = True
                elif obj.end is not None:
                    self.pos, self._state = obj.end, "close"
                    continue
                return
            i = skip_space(text, self.pos)
            if self._state == "brace":
                if i >= len(text):
                    self.ended = final
                    return
                if text[i] != "{":
                    self.ended = True
                    return
                self._current = CallState(parser.make_id(), obj=ObjectScan(i))
                parser.calls.append(self._current)
                self._state = "object"
                continue
            tag = {"open": self.open_tag, "close": self.close_tag, "separator": self.separator}[self._state]
            following = {"open": "brace", "close": "separator", "separator": "open"}[self._state]
            if tag:
                seen = text[i : i + len(tag)]
                if seen != tag and tag.startswith(seen) and not final:
                    return  # the text ends inside what may be the tag
                if seen == tag:
                    i += len(tag)
                elif self._state != "separator":  # the separator is optional, the tags are not
                    self.ended = True
                    return
            self.pos, self._state = i, following
