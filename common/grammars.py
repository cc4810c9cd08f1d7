"""A StructuredOutput as an xgrammar grammar: the one translation of each kind, shared by the api (which
checks a request's grammar when it parses it, with no tokenizer) and the worker (which compiles it against
the checkpoint's vocabulary). xgrammar was chosen by measurement (docs/structured_output.md)."""

from __future__ import annotations

import json
import re

import xgrammar as xgr

from pagedserve.common.grammar_chains import chain_bounded_repeats
from pagedserve.common.sampling_params import StructuredOutput

JSON_OBJECT_SCHEMA = '{"type": "object"}'  # response_format json_object: any JSON object, as vLLM
_LOCATION = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # xgrammar's "[time] file.cc:line: " before its message
_AFTER_REASONING = "root ::= [ \\t\\n]{0,4}"  # models put a line or two between </think> and the answer
# A Lark rule's head: `start: ...`, `?expr.2: ...`
_LARK_RULE = re.compile(r"^\s*[?!]?[a-z_][a-z0-9_]*(\.\d+)?\s*:", re.MULTILINE)


class GrammarError(ValueError):
    """A schema, regex, grammar or choice list that xgrammar refuses; the message says why."""


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """A grammar whose sentences are exactly `choices` (JSON string escapes are xgrammar's EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def is_lark(grammar: str) -> bool:
    """Whether a `grammar` constraint is written in Lark (rules `name: ...`, as vLLM also takes) rather than
    xgrammar's EBNF (`name ::= ...`)."""
    return "::=" not in grammar and _LARK_RULE.search(grammar) is not None


def grammar_of(structured: StructuredOutput) -> xgr.Grammar:
    """The grammar of `structured`, without a tokenizer. Raises GrammarError when xgrammar refuses it."""
    whitespace = structured.any_whitespace
    try:
        if structured.kind == "json_schema":
            grammar = xgr.Grammar.from_json_schema(structured.spec, any_whitespace=whitespace)
        elif structured.kind == "json_object":
            grammar = xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=whitespace)
        elif structured.kind == "regex":
            grammar = xgr.Grammar.from_regex(structured.spec)
        elif structured.kind == "choice":
            grammar = xgr.Grammar.from_ebnf(choice_ebnf(structured.choices))
        elif is_lark(structured.spec):
            grammar = xgr.Grammar.from_lark(structured.spec)
        else:
            grammar = xgr.Grammar.from_ebnf(structured.spec)
        if not structured.reasoning_end:
            return grammar
        reasoning = _reasoning(structured.reasoning_begin, structured.reasoning_end)
        return xgr.Grammar.concat(reasoning, xgr.Grammar.from_ebnf(_AFTER_REASONING), grammar)
    except (RuntimeError, ValueError, TypeError) as e:  # xgrammar raises RuntimeError from its C++ side
        raise GrammarError(_LOCATION.sub("", str(e).strip())[:500]) from e


def _reasoning(begin: str, end: str) -> xgr.Grammar:
    """`begin`, any text up to the first `end`, then `end`: a reasoning model's unconstrained thinking."""
    tag = {"type": "tag", "begin": begin, "content": {"type": "any_text"}, "end": end}
    return xgr.Grammar.from_structural_tag(json.dumps({"type": "structural_tag", "format": tag}))


def compile_grammar(compiler: xgr.GrammarCompiler, structured: StructuredOutput) -> xgr.CompiledGrammar:
    """`structured` compiled against `compiler`'s vocabulary: the grammar `grammar_of` builds, so the api's
    check and the worker's compile read each kind the same way. Raises GrammarError."""
    grammar = chain_bounded_repeats(grammar_of(structured))  # the same language, cheaper masks per step
    try:
        return compiler.compile_grammar(grammar)
    except (RuntimeError, ValueError, TypeError) as e:
        raise GrammarError(_LOCATION.sub("", str(e).strip())[:500]) from e
