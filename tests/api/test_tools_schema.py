"""The JSON schemas tool_choice `required` and a named function are held to (vLLM's), checked with
`jsonschema` against outputs that must pass and outputs that must not."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest

from pagedserve.api.errors import ApiError
from pagedserve.api.tools import ToolOptions, parse_tools
from pagedserve.common.config import ApiConfig

POINT = {
    "type": "object",
    "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
    "required": ["x", "y"],
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "draw",
            "parameters": {
                "type": "object",
                "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
                "required": ["from", "to"],
                "$defs": {"point": POINT},
            },
        },
    },
    {"type": "function", "function": {"name": "clear"}},
]


def options(body: dict[str, Any]) -> ToolOptions:
    return parse_tools({"tools": TOOLS, **body}, ApiConfig())


def test_required_schema_merges_defs_and_offers_each_tool() -> None:
    structured = options({"tool_choice": "required"}).structured()
    assert structured is not None and structured.kind == "json_schema"
    schema = json.loads(structured.spec)
    assert schema["$defs"] == {"point": POINT}
    good = [
        {"name": "draw", "parameters": {"from": {"x": 0, "y": 1}, "to": {"x": 2, "y": 3}}},
        {"name": "clear", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    bad_outputs = [
        [],
        [{"name": "draw", "parameters": {"from": {"x": 0}, "to": {"x": 2, "y": 3}}}],  # $ref followed
        [{"name": "erase", "parameters": {}}],
        [{"name": "clear"}],
        {"name": "clear", "parameters": {}},
    ]
    for bad in bad_outputs:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_schema_is_the_functions_parameters() -> None:
    named = options({"tool_choice": {"type": "function", "function": {"name": "draw"}}})
    assert named.schema() == TOOLS[0]["function"]["parameters"]
    empty = options({"tool_choice": {"type": "function", "function": {"name": "clear"}}})
    assert empty.schema() == {"type": "object", "properties": {}}
    assert options({"tool_choice": "none"}).structured() is None


def test_conflicting_defs_are_a_400() -> None:
    other = json.loads(json.dumps(TOOLS[0]))
    other["function"]["name"] = "draw2"
    other["function"]["parameters"]["$defs"]["point"] = {"type": "string"}
    with pytest.raises(ApiError) as refused:
        parse_tools({"tools": [TOOLS[0], other], "tool_choice": "required"}, ApiConfig()).structured()
    assert refused.value.status == 400 and refused.value.param == "tools"
