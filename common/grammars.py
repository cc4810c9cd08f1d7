"""A StructuredOutput as an xgrammar grammar: the one translation of each kind, shared by the api (which
checks a request's grammar when it parses it, with no tokenizer) and the worker (which compiles it against
the checkpoint's vocabulary). xgrammar was chosen by measurement (docs/structured_output.md)."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from common.sampling_params import StructuredOutput

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object, as vLLM
_LOCATION = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message


class GrammarError(ValueError):
    """A schema, regex, grammar or choice list that xgrammar refuses; the message says why."""


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """A grammar whose sentences are exactly `choices` (JSON string escapes are xgrammar's EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_of(structured: StructuredOutput) -> xgr.Grammar:
    """The grammar of `structured`, without a tokenizer. Raises GrammarError when xgrammar refuses it."""
    try:
        if structured.kind == "json_schema":
            return xgr.Grammar.from_json_schema(structured.spec, any_whitespace=structured.any_whitespace)
        if structured.kind == "json_object":
            return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=structured.any_whitespace)
        if structured.kind == "regex":
            return xgr.Grammar.from_regex(structured.spec)
        if structured.kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(structured.choices))
        return xgr.Grammar.from_ebnf(structured.spec)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError from its C++ side
        raise GrammarError(_LOCATION.sub("", str(e).strip())[:500]) from e


def compile_grammar(compiler: xgr.GrammarCompiler, structured: StructuredOutput) -> xgr.CompiledGrammar:
    """`structured` compiled against `compiler`'s vocabulary. Raises GrammarError."""
    try:
        if structured.kind == "json_schema":
            return compiler.compile_json_schema(structured.spec, any_whitespace=structured.any_whitespace)
        if structured.kind == "json_object":
            return compiler.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=structured.any_whitespace)
        if structured.kind == "regex":
            return compiler.compile_regex(structured.spec)
        if structured.kind == "choice":
            return compiler.compile_grammar(choice_ebnf(structured.choices))
        return compiler.compile_grammar(structured.spec)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(_LOCATION.sub("", str(e).strip())[:500]) from e
