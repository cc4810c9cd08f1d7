"""gpt-oss's harmony format (`openai`, vLLM's name): the output is a series of messages, each a header, then
`<|message|>`, the body, and `<|end|>`, `<|call|>` or `<|return|>` (or the end of the text: `<|call|>` and
`<|return|>` are stop tokens, which the text may not hold):

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a":1}<|call|>
    <|channel|>final<|message|>It is sunny.<|return|>

A message addressed `to=functions.NAME` (in its channel or its role part) is a call, its body the arguments'
JSON; the `final` channel's bodies are the content; the `analysis` channel (the model's reasoning) and
commentary to no one are not returned. A text that is not in the format at all is content, whole.

openai-harmony (OpenAI's Rust parser) is not used: it works on token ids and loads its encoding's vocabulary
file from the network on first use, which a server without network access cannot do; the format's strings
are few and fixed, and read here.
"""

from __future__ import annotations

import re
from typing import Any

from pagedserve.api.tool_parsers.base import CallState, ToolCall, ToolDelta, ToolParser, held_prefix
from pagedserve.api.tool_parsers.json_scan import ValueScan, skip_space

CHANNEL, START, MESSAGE = "<|channel|>", "<|start|>", "<|message|>"
ENDS = ("<|end|>", "<|call|>", "<|return|>")
_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyToolParser(ToolParser):
    name = "openai"
    reads_special_tokens = True  # every marker is a special token of gpt-oss's tokenizer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._mode = ""  # "harmony" or "plain", once the text's start tells
        self._pos = 0
        self._state = "header"  # header, content, skip, call
        self._content = ""
        self._content_sent = 0

    def feed(self, delta: str, final: bool = False) -> ToolDelta:
        self.text += delta
        if self._mode != "plain":
            self._advance(final)
        if self._mode == "plain":
            self._content = self.text
        out = ToolDelta(self._content[self._content_sent :])
        self._content_sent = len(self._content)
        self._add_call_deltas(out, final)
        return out

    def _whole_content(self) -> str:
        return self._content

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """As ToolParser's, but an answer in the format with no calls is its final channel, not its text."""
        content, calls = super().extract(text)
        if not self.calls and self._mode == "harmony":
            return (self._content or None), []
        return content, calls

    def _advance(self, final: bool) -> None:
        text = self.text
        if not self._mode:
            head = text.lstrip()
            if any(m.startswith(head) for m in (CHANNEL, START)) and not final:
                return  # too short to tell
            self._mode = "harmony" if head.startswith((CHANNEL, START)) else "plain"
            if self._mode == "plain":
                return
        while self._message(text, final):
            pass

    def _body_end(self, text: str, final: bool) -> tuple[int, int]:
        """Where the body from self._pos ends and where the next message starts (-1, -1 while unknown);
        while unknown, the first result is how far the body surely goes."""
        found = [(i, m) for m in ENDS if (i := text.find(m, self._pos)) >= 0]
        if found:
            i, marker = min(found)
            return i, i + len(marker)
        if final:
            return len(text), len(text)
        return len(text) - max(held_prefix(text, m) for m in ENDS), -1

    def _message(self, text: str, final: bool) -> bool:
        """Reads on from self._pos; False when the text must grow first."""
        if self._state == "header":
            at = text.find(MESSAGE, self._pos)
            if at < 0:
                return False
            header = text[self._pos : at]
            self._pos = at + len(MESSAGE)
            recipient = _RECIPIENT.search(header)
            channel = _CHANNEL_NAME.search(header)
            if recipient is not None:
                self.calls.append(CallState(self.make_id(), name=recipient.group(1)))
                self._state = "call"
            else:
                self._state = "content" if channel is not None and channel.group(1) == "final" else "skip"
            return True
        if self._state == "call":
            call = self.calls[-1]
            if call._args is None:
                start = skip_space(text, self._pos)
                if start >= len(text):
                    return False
                call._args = ValueScan(start)
            if call._args.advance(text, final) is None:
                return False
            self._pos = call._args.end or self._pos
        end, after = self._body_end(text, final)
        if self._state == "content":
            self._content += text[self._pos : end]
        self._pos = max(self._pos, end)  # what is surely body is not searched again (one pass per response)
        if after < 0:
            return False
        self._pos, self._state = after, "header"
        return after < len(text)
