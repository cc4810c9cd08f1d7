"""Tool-call parsers, chosen with --tool-call-parser (vLLM's names): each finds the calls of one model
family's format in a choice's text, whole or streamed.

base.py         ToolParser (feed / finish / extract), CallState, ToolCall, tool call ids
json_scan.py    where JSON values and objects end in a growing text, resumably
hermes.py       `hermes`: <tool_call>{...}</tool_call> (Hermes, Qwen 2.5/3)
llama3_json.py  `llama3_json`: {"name": ..., "parameters": ...}; ... (Llama 3.1/3.2)
mistral.py      `mistral`: [TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}
forced.py       the JSON that tool_choice `required` or a named function is constrained to
"""

from __future__ import annotations

from pagedserve.api.tool_parsers.base import ToolCall, ToolDelta, ToolParser
from pagedserve.api.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedserve.api.tool_parsers.hermes import HermesToolParser
from pagedserve.api.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.api.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}

__all__ = [
    "TOOL_PARSERS",
    "NamedToolParser",
    "RequiredToolParser",
    "ToolCall",
    "ToolDelta",
    "ToolParser",
]
