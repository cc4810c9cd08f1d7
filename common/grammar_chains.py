"""Bounded repetitions followed by a literal, rewritten as chains of rules, so that xgrammar can decide each
token's fate when it compiles the grammar instead of at every step.

A JSON schema's `{"type": "string", "maxLength": 40}` becomes `"\\"" chars{0, 40} "\\""` in xgrammar 0.2.8.
In that repetition xgrammar's precomputed token masks cannot tell whether a token longer than the
characters left fits, so near the end of such a string nearly every token of the vocabulary is re-checked
character by character at each step (measured: about 300 µs a row with a 4,096-token vocabulary, 4-5 ms with
128k, against 1-2 µs elsewhere), and the rows in such strings set a step's host cost.

The same language written as `"\\"" chars_then_40` with

    chars_then_0 ::= "\\""
    chars_then_k ::= "\\"" | (chars chars_then_{k-1})

keeps every token that stays inside the string (or runs past its last allowed character) within the
rules below the state, where the compiler's masks decide it; only tokens that run past the closing
literal into what follows are checked per step, as for any other rule. The grammar accepts the same
sentences, so the masks are the same (tests/test_grammar_chains.py compares them along random walks).

The rewrite works on the grammar's printed EBNF (`str(grammar)`), which `Grammar.from_ebnf` reads back; a
grammar with nothing to rewrite, or whose text does not read back, is returned as it is.
"""

from __future__ import annotations

import json
import logging
import re

import xgrammar as xgr

log = logging.getLogger(__name__)

# Rules (and required copies) a grammar may gain: each costs compile time (1-20 ms with a 128k
# vocabulary, more in longer chains: maxLength 256 compiles in 3.0 s instead of 2.8, 1000 in 25 s instead
# of 7), and a hostile maxLength must not turn a compile into minutes. Longer repetitions stay as they are.
MAX_CHAIN_RULES = 256

# The printed EBNF's tokens: a string literal, a character class, a bounded or unbounded repetition, a
# name, a run of whitespace, any other character.
_TOKEN = re.compile(
    r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|\{\d+, -?\d+\}|[A-Za-z_][A-Za-z0-9_.\-]*|\s+|.', re.DOTALL
)
_REPEAT = re.compile(r"\{(\d+), (-?\d+)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")


def chain_bounded_repeats(grammar: xgr.Grammar, max_rules: int = MAX_CHAIN_RULES) -> xgr.Grammar:
    """`grammar` with each `name{lo, hi} "literal"` (hi finite) written as `name` lo times followed by a
    chain of hi - lo + 1 rules ending in the literal: the same language, cheaper masks per step."""
    text = str(grammar)
    rewritten = chain_text(text, max_rules)
    if rewritten == text:
        return grammar
    root = json.loads(grammar.serialize_json())
    root_name = root["rules"][root["root_rule_id"]][0]
    try:
        return xgr.Grammar.from_ebnf(rewritten, root_rule_name=root_name)
    except (RuntimeError, ValueError) as e:  # a construct whose printed form does not read back
        log.warning("bounded repetitions left as they are: %s", str(e).strip()[:200])
        return grammar


def chain_text(text: str, max_rules: int = MAX_CHAIN_RULES) -> str:
    """The rewrite of `chain_bounded_repeats` on printed EBNF `text` (its rules' names all distinct)."""
    tokens = _TOKEN.findall(text)
    taken = set(tokens)  # every name already in the grammar: new rules must not clash with them
    chains: dict[tuple[str, str], tuple[str, int]] = {}  # (name, literal) -> (chain's prefix, longest)
    out: list[str] = []
    budget = max_rules
    i = 0
    while i < len(tokens):
        found = _bounded_repeat(tokens, i)
        if found is None:
            out.append(tokens[i])
            i += 1
            continue
        name, lo, hi, literal, end = found
        prefix, longest = chains.get((name, literal), ("", -1))
        # the new rules, and the `lo` copies of `name`, each a state the compiler precomputes masks for
        grow = lo + max(0, hi - lo - longest)
        if grow > budget:
            out.append(tokens[i])
            i += 1
            continue
        budget -= grow
        if not prefix:
            prefix = _fresh_name(f"{name}_then_{len(chains)}", taken)
        chains[(name, literal)] = (prefix, max(longest, hi - lo))
        out.append("(" + " ".join([name] * lo + [f"{prefix}_{hi - lo}"]) + ")")
        i = end
    if not chains:
        return text
    rules = []
    for (name, literal), (prefix, longest) in chains.items():
        rules.append(f"{prefix}_0 ::= {literal}")
        rules += [f"{prefix}_{k} ::= ({literal} | ({name} {prefix}_{k - 1}))" for k in range(1, longest + 1)]
    return "".join(out).rstrip("\n") + "\n" + "\n".join(rules) + "\n"


def _bounded_repeat(tokens: list[str], i: int) -> tuple[str, int, int, str, int] | None:
    """(name, lo, hi, literal, index past them) when tokens[i:] open with `name{lo, hi} "literal"`."""
    if i + 3 >= len(tokens) or not _NAME.fullmatch(tokens[i]):
        return None
    repeat = _REPEAT.fullmatch(tokens[i + 1])
    if repeat is None or int(repeat.group(2)) < 0:
        return None
    j = i + 2
    if tokens[j].isspace():
        j += 1
    literal = tokens[j] if j < len(tokens) else ""
    if len(literal) < 3 or not literal.startswith('"'):  # a non-empty string literal
        return None
    return tokens[i], int(repeat.group(1)), int(repeat.group(2)), literal, j + 1


def _fresh_name(name: str, taken: set[str]) -> str:
    while name in taken or any(t.startswith(name + "_") for t in taken):
        name += "x"
    taken.add(name)
    return name
