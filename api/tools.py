"""A chat request's `tools`, `tool_choice` and `parallel_tool_calls`, checked and bounded, and what they
ask of generation: the JSON schema that `required` or a named function is enforced with (vLLM's), and the
parser that turns the output into `tool_calls`.

`auto` (the default when tools are given) reads the calls with --tool-call-parser's parser, or with no flag
the one the chat template's format asks for (api/tool_parsers/detect.py: hermes, qwen3_coder, gpt-oss's
harmony, ...); with neither it is vLLM's 400. `none` keeps the tools in the prompt and parses nothing;
`required` constrains the output to a JSON array of {"name", "parameters"} objects, one of the tools each;
a named function constrains it to that function's parameters. `parallel_tool_calls: false` keeps one call
(the schema allows one, and a parser's later calls are dropped).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

import jsonschema

from pagedserve.api.errors import invalid
from pagedserve.api.fields import show
from pagedserve.api.tool_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolParser
from pagedserve.common.config import ApiConfig
from pagedserve.common.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutput

MAX_TOOLS = 128
MAX_TOOL_CHARS = 64 * 1024  # one tool's definition as JSON
MAX_FUNCTION_NAME_CHARS = 64  # OpenAI's limit
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")  # OpenAI's characters, and the dots of MCP names
TOOL_KEYS = frozenset({"name", "description", "parameters", "strict"})
EMPTY_PARAMETERS = {"type": "object", "properties": {}}

CHOICE_FORMS = (
    "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}"
)
ToolChoice = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolOptions:
    """What a request's tool fields ask for."""

    tools: list[dict[str, Any]]  # as the chat template takes them: {"type": "function", "function": {...}}
    choice: ToolChoice
    function_name: str = ""  # the named function
    parallel: bool = True  # parallel_tool_calls
    parser_name: str = ""  # auto: the parser of the model's format (--tool-call-parser, else detected)

    def _parameters(self, tool: dict[str, Any]) -> dict[str, Any]:
        return tool["function"].get("parameters") or EMPTY_PARAMETERS

    def schema(self) -> dict[str, Any] | None:
        """The JSON schema the output is held to, for `required` and a named function."""
        if self.choice == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.function_name)
            return self._parameters(tool)
        if self.choice != "required":
            return None
        definitions: dict[str, Any] = {}
        options = []
        for tool in self.tools:
            parameters = self._parameters(tool)
            for name, definition in (parameters.get("$defs") or {}).items():
                if definitions.setdefault(name, definition) != definition:
                    raise invalid(f"the tools define '$defs' entry {show(name)} differently", "tools")
            name_schema = {"type": "string", "enum": [tool["function"]["name"]]}
            options.append(
                {
                    "properties": {"name": name_schema, "parameters": parameters},
                    "required": ["name", "parameters"],
                }
            )
        schema: dict[str, Any] = {
            "type": "array",
            "minItems": 1,
            "items": {"type": "object", "anyOf": options},
        }
        if not self.parallel:
            schema["maxItems"] = 1
        if definitions:
            schema["$defs"] = definitions
        return schema

    def structured(self) -> StructuredOutput | None:
        schema = self.schema()
        if schema is None:
            return None
        spec = json.dumps(schema, ensure_ascii=False)
        if len(spec) > MAX_GRAMMAR_CHARS:
            raise invalid(f"the tools' schema is over {MAX_GRAMMAR_CHARS} characters", "tools")
        # Compact JSON: the calls' layout carries nothing, and with free whitespace a weak model can spend all
        # of max_tokens on it (vLLM's disable_any_whitespace)
        return StructuredOutput(kind="json_schema", spec=spec, any_whitespace=False)

    def parser(self, config: ApiConfig) -> ToolParser | None:
        """A fresh parser for one choice's output, or None when the output is not parsed for calls."""
        if self.choice == "named":
            return NamedToolParser(self.function_name)
        if self.choice == "required":
            return RequiredToolParser()
        if self.choice == "auto":
            return TOOL_PARSERS[self.parser_name](tools=self.tools)
        return None


def _tool(value: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(value, dict) or value.get("type") != "function" or set(value) - {"type", "function"}:
        raise invalid(f"{where} must be {{'type': 'function', 'function': {{...}}}}", "tools")
    function = value.get("function")
    if not isinstance(function, dict) or set(function) - TOOL_KEYS:
        raise invalid(f"{where}.function must be an object with keys among {sorted(TOOL_KEYS)}", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
        raise invalid(
            f"{where}.function.name must be 1 to {MAX_FUNCTION_NAME_CHARS} letters, digits, '_', '-', '.' "
            f"or ':', got {show(name)}",
            "tools",
        )
    if not isinstance(function.get("description", ""), str):
        raise invalid(f"{where}.function.description must be a string", "tools")
    if not isinstance(function.get("strict", False), bool):
        raise invalid(f"{where}.function.strict must be a boolean", "tools")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise invalid(f"{where}.function.parameters must be a JSON schema object", "tools")
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.SchemaError as e:
            raise invalid(
                f"{where}.function.parameters is not a valid JSON schema: {e.message[:200]}", "tools"
            ) from None
    if len(json.dumps(value, ensure_ascii=False)) > MAX_TOOL_CHARS:
        raise invalid(f"{where} is over {MAX_TOOL_CHARS} characters as JSON", "tools")
    return {"type": "function", "function": function}


def parse_tools(body: dict[str, Any], config: ApiConfig, detected_parser: str = "") -> ToolOptions:
    """The request's tool fields; a 400 for anything we would not honour. `detected_parser`: the parser the
    served chat template asks for, used when --tool-call-parser is not given."""
    raw = body.get("tools")
    if raw is not None and (not isinstance(raw, list) or len(raw) > MAX_TOOLS):
        raise invalid(f"'tools' must be a list of at most {MAX_TOOLS} tools", "tools")
    tools = [_tool(t, i) for i, t in enumerate(raw or [])]
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise invalid("the tools' function names must be unique", "tools")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid(f"'parallel_tool_calls' must be a boolean, got {show(parallel)}", "parallel_tool_calls")
    choice_value = body.get("tool_choice")
    if choice_value is None:
        choice_value = "auto" if tools else "none"
    function_name = ""
    if isinstance(choice_value, dict):
        function = choice_value.get("function")
        if (
            choice_value.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
        ):
            raise invalid(CHOICE_FORMS, "tool_choice")
        function_name = function["name"]
        if function_name not in names:
            raise invalid(
                f"tool_choice names {show(function_name)}, which is not one of the tools", "tool_choice"
            )
        choice: ToolChoice = "named"
    elif choice_value in ("none", "auto", "required"):
        choice = choice_value
    else:
        raise invalid(
            f"'tool_choice' must be 'none', 'auto', 'required' or a function, got {show(choice_value)}",
            "tool_choice",
        )
    if choice in ("required", "auto") and not tools and body.get("tool_choice") is not None:
        raise invalid(f"tool_choice '{choice}' needs 'tools'", "tool_choice")
    # The flags, when given, decide as in vLLM; without them the template's format does
    parser_name = config.tool_call_parser or detected_parser
    if config.tool_call_parser and not config.enable_auto_tool_choice:
        parser_name = ""
    if choice == "auto" and not parser_name:
        raise invalid(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
            "tool_choice",
        )
    return ToolOptions(tools, choice, function_name, True if parallel is None else parallel, parser_name)
