"""Which tool-call parser a checkpoint's chat template asks for, so that tool_choice `auto` works with no
flags: a template that renders `tools` writes, for the assistant's past calls and in its instructions, the
very markers its model emits, and each family's markers are its own. --tool-call-parser overrides this.

The markers are the models' real strings (their chat templates, and vLLM's parsers of the same names);
they are tried most specific first, since qwen3_coder and glm45 also wrap calls in `<tool_call>`.
"""

from __future__ import annotations

import re
from typing import Any

_RENDERS_TOOLS = re.compile(r"\btools\b")
# (parser, markers that must all appear in the template), most specific first
_SIGNATURES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("openai", ("<|channel|>", "<|message|>", "functions")),  # gpt-oss's harmony format
    ("qwen3_coder", ("<function=", "<parameter=")),
    ("glm45", ("<arg_key>", "<arg_value>")),
    ("kimi_k2", ("<|tool_call_begin|>", "<|tool_call_argument_begin|>")),
    ("deepseek_v31", ("<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")),
    ("mistral", ("[TOOL_CALLS]",)),
    ("hermes", ("<tool_call>",)),
    ("llama3_json", ("<|start_header_id|>", '"parameters"')),
)


def template_text(template: Any) -> str:
    """A tokenizer's chat_template as one text: a dict of named templates (some checkpoints ship a
    separate `tool_use` one) is read whole."""
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else ""


def detect_tool_parser(template: str) -> str:
    """The parser whose format `template` writes, or "" when it renders no tools or no format we know."""
    if not _RENDERS_TOOLS.search(template):
        return ""
    for name, markers in _SIGNATURES:
        if all(m in template for m in markers):
            if name == "deepseek_v31" and ("```json" in template or "function<｜tool▁sep｜>" in template):
                return ""  # DeepSeek V3's and R1's older form (type, name, a ```json block): not parsed
            return name
    return ""
