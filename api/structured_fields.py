"""A request's output constraint as a StructuredOutput: OpenAI's `response_format` (`json_object`, and
`json_schema` with its `schema` and `strict`), vLLM's `structured_outputs` ({"json"}, {"regex"}, {"choice"},
{"grammar"} or {"json_object": true}, with `disable_any_whitespace`), and vLLM's older `guided_json`,
`guided_regex`, `guided_choice`, `guided_grammar` (removed from vLLM in 0.12; kept here for older clients),
on both /v1/completions and /v1/chat/completions.

JSON is compact by default (no free whitespace between tokens, as OpenAI's structured outputs): with free
whitespace a random or weak model at temperature 1 draws spaces and newlines until max_tokens (vLLM #38696).
`structured_outputs: {"disable_any_whitespace": false}` allows it, given alone or beside `response_format`
(a `structured_outputs` of options only applies them to the `response_format` constraint).

Every constraint is turned into its grammar here, in the api's tokenizer thread, by the same translation the
worker compiles (common/grammars.py, xgrammar): a schema, regex or grammar that xgrammar refuses is a 400
naming it, never a failure in the worker. Grammars are EBNF as xgrammar reads it (GBNF-style `root ::= ...`).
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pagedserve.api.errors import invalid
from pagedserve.api.fields import show
from pagedserve.common.sampling_params import MAX_CHOICES, MAX_GRAMMAR_CHARS, StructuredOutput

LEGACY_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *LEGACY_FIELDS})
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema's objects and arrays
# structured_outputs keys: one constraint, and its options
_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
_OPTIONS = ("disable_any_whitespace", "disable_fallback", "disable_additional_properties")


def _depth(value: Any, limit: int) -> int:
    """The nesting depth of a JSON value, counted up to `limit + 1` (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack and deepest <= limit:
        item, depth = stack.pop()
        deepest = max(deepest, depth)
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return deepest


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise invalid(f"'{param}' must be a JSON schema: {str(e)[:200]}", param) from e
    if not isinstance(schema, dict | bool):
        raise invalid(f"'{param}' must be a JSON schema (an object), got {show(schema)}", param)
    if _depth(schema, MAX_SCHEMA_DEPTH) > MAX_SCHEMA_DEPTH:
        raise invalid(f"'{param}' is nested more than {MAX_SCHEMA_DEPTH} levels deep", param)
    text = json.dumps(schema, ensure_ascii=False)
    if len(text) > MAX_GRAMMAR_CHARS:
        raise invalid(f"'{param}' must be at most {MAX_GRAMMAR_CHARS} characters of JSON", param)
    return text


def _text(value: Any, param: str, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS:
        raise invalid(
            f"'{param}' must be a non-empty {what} of at most {MAX_GRAMMAR_CHARS} characters", param
        )
    return value


def _choices(value: Any, param: str) -> tuple[str, ...]:
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= MAX_CHOICES
        or not all(isinstance(c, str) for c in value)
        or sum(len(c) for c in value) > MAX_GRAMMAR_CHARS
    ):
        raise invalid(
            f"'{param}' must be a list of 1 to {MAX_CHOICES} strings, at most {MAX_GRAMMAR_CHARS} characters "
            "in all",
            param,
        )
    return tuple(value)


def _response_format(value: Any) -> StructuredOutput | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise invalid("'response_format' must be an object with a 'type'", param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise invalid(
            f"response_format type {show(kind)} is not supported (text, json_object, json_schema)", param
        )
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or "schema" not in spec:
        raise invalid("response_format json_schema needs 'json_schema': {'name', 'schema', 'strict'}", param)
    name = spec.get("name")
    if name is not None and (not isinstance(name, str) or len(name) > 256):
        raise invalid("response_format json_schema 'name' must be a string of at most 256 characters", param)
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise invalid("response_format json_schema 'strict' must be a boolean", param)
    # strict or not, the output follows the schema exactly (as vLLM does)
    return StructuredOutput("json_schema", _schema_text(spec["schema"], param))


def _structured_outputs(value: Any, beside: StructuredOutput | None) -> tuple[str, StructuredOutput]:
    """`value`'s constraint; with options only, `beside` (response_format's) with the options applied."""
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise invalid("'structured_outputs' must be an object", param)
    unknown = sorted(set(value) - set(_CONSTRAINTS) - set(_OPTIONS))
    if unknown:
        raise invalid(f"structured_outputs: unsupported key(s) {', '.join(unknown)[:200]}", param)
    for option in _OPTIONS:
        if value.get(option) is not None and not isinstance(value[option], bool):
            raise invalid(f"structured_outputs '{option}' must be a boolean", param)
    if value.get("disable_additional_properties") is False:  # xgrammar's strict mode allows none unless asked
        raise invalid("structured_outputs 'disable_additional_properties': false is not supported", param)
    # vLLM's option, but compact unless it is explicitly false (vLLM allows whitespace unless it is true)
    any_whitespace = value.get("disable_any_whitespace") is False
    given = [k for k in _CONSTRAINTS if value.get(k) not in (None, False)]
    if not given and beside is not None:
        return "response_format", msgspec.structs.replace(beside, any_whitespace=any_whitespace)
    if len(given) != 1:
        raise invalid(f"structured_outputs needs exactly one of {', '.join(_CONSTRAINTS)}", param)
    name = f"{param}.{given[0]}"
    return name, _constraint(given[0], value[given[0]], name, any_whitespace)


def _constraint(kind: str, value: Any, param: str, any_whitespace: bool = False) -> StructuredOutput:
    if kind == "json":
        return StructuredOutput("json_schema", _schema_text(value, param), any_whitespace=any_whitespace)
    if kind == "json_object":
        if value is not True:
            raise invalid(f"'{param}' must be true", param)
        return StructuredOutput("json_object", any_whitespace=any_whitespace)
    if kind == "regex":
        return StructuredOutput("regex", _text(value, param, "regular expression"))
    if kind == "choice":
        return StructuredOutput("choice", choices=_choices(value, param))
    return StructuredOutput("grammar", _text(value, param, "grammar"))


def parse_structured(body: dict[str, Any]) -> StructuredOutput | None:
    """The request's constraint (at most one way of giving it), checked by xgrammar; None for free text.
    Raises ApiError (400) naming the field."""
    found: list[tuple[str, StructuredOutput]] = []
    if body.get("response_format") is not None:
        structured = _response_format(body["response_format"])
        if structured is not None:
            found.append(("response_format", structured))
    if body.get("structured_outputs") is not None:
        options = _structured_outputs(body["structured_outputs"], found[0][1] if found else None)
        found = [options] if options[0] == "response_format" else [*found, options]
    for name in LEGACY_FIELDS:
        if body.get(name) is not None:
            found.append((name, _constraint(name.removeprefix("guided_"), body[name], name)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(name.split(".")[0] for name, _ in found)
        raise invalid(f"give one output constraint, not several ({names})", found[1][0])
    param, structured = found[0]
    from pagedserve.common.grammars import GrammarError, grammar_of  # xgrammar (and torch) load on first use

    try:
        grammar_of(structured)
    except GrammarError as e:
        raise invalid(f"'{param}' is not a valid {_NAMES[structured.kind]}: {e}", param) from e
    return structured


_NAMES = {
    "json_schema": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regular expression",
    "choice": "choice list",
    "grammar": "EBNF grammar",
}
