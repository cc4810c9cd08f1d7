"""Argument values written as untyped text (qwen3_coder's `<parameter=k>v</parameter>`, glm45's
`<arg_value>v</arg_value>`) read as JSON values by the request's tool schemas, as those models' chat templates
write them and vLLM's parsers read them: a string-typed parameter's text is the string itself; any other
parameter's text is JSON (the templates write objects, arrays, numbers and booleans with `tojson`), and text
that does not parse stays a string. A parameter the tools do not declare is read as JSON if it parses."""

from __future__ import annotations

import json
from typing import Any


def parameter_schemas(tools: list[dict[str, Any]], name: str) -> dict[str, Any]:
    """The properties of function `name`'s parameters among `tools` (empty when it is not one of them)."""
    for tool in tools:
        function = tool.get("function") or {}
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties")
            return properties if isinstance(properties, dict) else {}
    return {}


def _is_string(schema: Any) -> bool:
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind):
        return True
    return isinstance(schema.get("enum"), list) and all(isinstance(e, str) for e in schema["enum"])


def typed_value(raw: str, schema: Any) -> Any:
    """`raw` as the parameter's value under `schema` (None when the parameter is not declared)."""
    if _is_string(schema):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        if raw in ("True", "False"):  # a Python bool written with jinja's `string` filter
            return raw == "True"
        return raw
