"""Kimi K2: the calls in one section, each with the model's own call id `functions.NAME:INDEX` (which names
the function and, as Kimi's chat template writes it back, is the call's id) and its arguments' JSON; the text
before the section is the content:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>
    {"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

(with no newlines in the real output). The markers are special tokens, read only while they are kept.
"""

from __future__ import annotations

from pagedserve.api.tool_parsers.base import CallState
from pagedserve.api.tool_parsers.deepseek_v31 import SectionToolParser

MAX_ID_CHARS = 256


class KimiK2ToolParser(SectionToolParser):
    name = "kimi_k2"
    BEGINS = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")  # both spellings are seen
    CALL, SEP, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"

    def _call(self, header: str) -> CallState:
        call_id = header.strip()
        name = call_id.removeprefix("functions.").rsplit(":", 1)[0]
        taken = {c.id for c in self.calls}
        if not call_id or len(call_id) > MAX_ID_CHARS or call_id in taken:
            call_id = self.make_id()
        return CallState(call_id, name=name)
