"""Output constraints in the api (api/structured_fields.py): every way of giving one reaches the scheduler as
the same StructuredOutput, on both endpoints; a schema, regex, grammar or choice list that xgrammar refuses,
or that is too large, is a 400 naming the field, and the server keeps serving."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pagedserve.api.structured_fields import MAX_SCHEMA_DEPTH
from pagedserve.common.sampling_params import MAX_CHOICES, MAX_GRAMMAR_CHARS, StructuredOutput
from tests.api.harness import ApiServer

USER = [{"role": "user", "content": "answer in JSON"}]
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SCHEMA_TEXT = json.dumps(SCHEMA)
LARK = 'start: answer+\nanswer: "yes" | "no" NUMBER\nNUMBER: /[0-9]+/\n'  # vLLM takes Lark as well as EBNF

ACCEPTED: list[tuple[str, dict[str, Any], StructuredOutput | None]] = [
    ("text", {"response_format": {"type": "text"}}, None),
    ("json_object", {"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
    (
        "json_schema strict",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": SCHEMA, "strict": True},
            }
        },
        StructuredOutput("json_schema", SCHEMA_TEXT),
    ),
    (
        "json_schema as text",
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA_TEXT}}},
        StructuredOutput("json_schema", SCHEMA_TEXT),
    ),
    (
        "structured json",
        {"structured_outputs": {"json": SCHEMA}},
        StructuredOutput("json_schema", SCHEMA_TEXT),
    ),
    (
        "structured json, no whitespace",
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        StructuredOutput("json_schema", SCHEMA_TEXT, any_whitespace=False),
    ),
    (
        "structured json, whitespace allowed",
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}},
        StructuredOutput("json_schema", SCHEMA_TEXT, any_whitespace=True),
    ),
    (
        "json_schema, whitespace allowed beside it",
        {
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
            "structured_outputs": {"disable_any_whitespace": False},
        },
        StructuredOutput("json_schema", SCHEMA_TEXT, any_whitespace=True),
    ),
    (
        "json_object, whitespace allowed beside it",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": False}},
        StructuredOutput("json_object", any_whitespace=True),
    ),
    (
        "structured json_object",
        {"structured_outputs": {"json_object": True}},
        StructuredOutput("json_object"),
    ),
    ("structured regex", {"structured_outputs": {"regex": "[a-z]+"}}, StructuredOutput("regex", "[a-z]+")),
    (
        "structured choice",
        {"structured_outputs": {"choice": ["yes", "no"]}},
        StructuredOutput("choice", choices=("yes", "no")),
    ),
    (
        "structured grammar",
        {"structured_outputs": {"grammar": 'root ::= "a" | "b"'}},
        StructuredOutput("grammar", 'root ::= "a" | "b"'),
    ),
    (
        "structured grammar, Lark",
        {"structured_outputs": {"grammar": LARK}},
        StructuredOutput("grammar", LARK),
    ),
    ("guided_json", {"guided_json": SCHEMA}, StructuredOutput("json_schema", SCHEMA_TEXT)),
    ("guided_regex", {"guided_regex": r"\d+"}, StructuredOutput("regex", r"\d+")),
    ("guided_choice", {"guided_choice": ["x"]}, StructuredOutput("choice", choices=("x",))),
    ("guided_grammar", {"guided_grammar": 'root ::= "z"'}, StructuredOutput("grammar", 'root ::= "z"')),
]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("name,fields,expected", ACCEPTED, ids=[a[0] for a in ACCEPTED])
def test_each_form_reaches_the_scheduler(server: ApiServer, endpoint, name, fields, expected) -> None:
    if endpoint == "chat":
        path, body = "/v1/chat/completions", {"messages": USER, "max_tokens": 2, **fields}
    else:
        path, body = "/v1/completions", {"prompt": "abc", "max_tokens": 2, **fields}
    reply = server.post(path, body)
    assert reply.status == 200, reply.json()
    assert server.fake.submits()[-1].params.structured == expected


def _deep_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("unknown schema type", {"structured_outputs": {"json": {"type": "frob"}}}, "structured_outputs.json"),
    ("dangling $ref", {"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json"),
    ("schema not JSON", {"guided_json": "{not json"}, "guided_json"),
    ("schema a list", {"guided_json": [1]}, "guided_json"),
    ("bad regex", {"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
    ("empty regex", {"guided_regex": ""}, "guided_regex"),
    ("bad grammar", {"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs.grammar"),
    ("empty choices", {"guided_choice": []}, "guided_choice"),
    ("choice not strings", {"guided_choice": ["a", 1]}, "guided_choice"),
    ("too many choices", {"guided_choice": ["a"] * (MAX_CHOICES + 1)}, "guided_choice"),
    ("two constraints", {"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ("two keys", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("options beside text", {"response_format": {"type": "text"}, "structured_outputs": {}},
     "structured_outputs"),
    (
        "response_format and a json",
        {"response_format": {"type": "json_object"}, "structured_outputs": {"json": SCHEMA}},
        "structured_outputs.json",
    ),
    ("none in structured_outputs", {"structured_outputs": {"disable_fallback": True}}, "structured_outputs"),
    ("unknown key", {"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "structured_outputs"),
    ("json_object false", {"structured_outputs": {"json_object": "yes"}}, "structured_outputs.json_object"),
    ("unknown response_format", {"response_format": {"type": "structural_tag"}}, "response_format"),
    ("no schema", {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    ("schema too deep", {"guided_json": _deep_schema(MAX_SCHEMA_DEPTH + 1)}, "guided_json"),
    ("schema too large", {"guided_json": {"enum": ["x" * MAX_GRAMMAR_CHARS]}}, "guided_json"),
    ("regex too large", {"guided_regex": "a" * (MAX_GRAMMAR_CHARS + 1)}, "guided_regex"),
]  # fmt: skip


@pytest.mark.parametrize("name,fields,param", BAD, ids=[b[0] for b in BAD])
def test_bad_constraints_are_400s_naming_the_field(server: ApiServer, name, fields, param) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, **fields}),
        ("/v1/completions", {"prompt": "abc", "max_tokens": 2, **fields}),
    ):
        reply = server.post(path, body)
        assert reply.status == 400, (path, name)
        error = reply.json()["error"]
        assert error["type"] == "invalid_request_error"
        assert error["param"] == param, error
    assert server.post("/v1/completions", {"prompt": "abc", "max_tokens": 1}).status == 200


def test_invalid_schema_error_says_why(server: ApiServer) -> None:
    reply = server.post("/v1/chat/completions", {"messages": USER, "guided_json": {"type": "frob"}})
    message = reply.json()["error"]["message"]
    assert "not a valid JSON schema" in message and "frob" in message


def test_beam_search_with_a_constraint_is_refused(server: ApiServer) -> None:
    body = {"prompt": "abc", "max_tokens": 2, "use_beam_search": True, "n": 2, "guided_choice": ["a", "b"]}
    reply = server.post("/v1/completions", body)
    assert reply.status == 400
    assert "beam search" in reply.json()["error"]["message"]


def test_min_tokens_with_a_constraint_is_refused(server: ApiServer) -> None:
    """A completed grammar allows only EOS and the stop tokens, which min_tokens bans: nothing is left."""
    body = {"prompt": "abc", "max_tokens": 8, "min_tokens": 4, "guided_choice": ["a", "b"]}
    reply = server.post("/v1/completions", body)
    assert reply.status == 400
    assert "min_tokens" in reply.json()["error"]["message"]
    assert server.post("/v1/completions", {**body, "min_tokens": 0}).status == 200
