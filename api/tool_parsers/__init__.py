"""Tool-call parsers, chosen with --tool-call-parser (vLLM's names): each finds the calls of one model
family's format in a choice's text, whole or streamed.

base.py         ToolParser (feed / finish / extract), CallState, ToolCall, tool call ids
json_scan.py    where JSON values and objects end in a growing text, resumably
hermes.py       `hermes`: <tool_call>{...}</tool_call> (Hermes, Qwen 2.5/3)
llama3_json.py  `llama3_json`: {"name": ..., "parameters": ...}; ... (Llama 3.1/3.2)
mistral.py      `mistral`: [TOOL_CALLS][{...}] or [TOOL_CALLS]name[ARGS]{...}
qwen3_coder.py  `qwen3_coder`: <tool_call><function=name><parameter=k>v</parameter></function></tool_call>
glm45.py        `glm45`: <tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value></tool_call>
deepseek_v31.py `deepseek_v31`: <｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜> in a section
kimi_k2.py      `kimi_k2`: <|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...} in a section
harmony.py      `openai`: gpt-oss's harmony messages, `to=functions.name` ... <|message|>{...}<|call|>
typed_values.py untyped argument text (qwen3_coder, glm45) read by the tools' schemas
detect.py       the parser a chat template's format asks for (tool_choice auto with no flags)
forced.py       the JSON that tool_choice `required` or a named function is constrained to
"""

from __future__ import annotations

from pagedserve.api.tool_parsers.base import ToolCall, ToolDelta, ToolParser
from pagedserve.api.tool_parsers.deepseek_v31 import DeepSeekV31ToolParser
from pagedserve.api.tool_parsers.forced import NamedToolParser, RequiredToolParser
from pagedserve.api.tool_parsers.glm45 import Glm45ToolParser
from pagedserve.api.tool_parsers.harmony import HarmonyToolParser
from pagedserve.api.tool_parsers.hermes import HermesToolParser
from pagedserve.api.tool_parsers.kimi_k2 import KimiK2ToolParser
from pagedserve.api.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedserve.api.tool_parsers.mistral import MistralToolParser
from pagedserve.api.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesToolParser,
        Llama3JsonToolParser,
        MistralToolParser,
        Qwen3CoderToolParser,
        Glm45ToolParser,
        DeepSeekV31ToolParser,
        KimiK2ToolParser,
        HarmonyToolParser,
    )
}

__all__ = [
    "TOOL_PARSERS",
    "NamedToolParser",
    "RequiredToolParser",
    "ToolCall",
    "ToolDelta",
    "ToolParser",
]
