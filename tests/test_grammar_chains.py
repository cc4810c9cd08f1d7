"""common/grammar_chains.py: the rewritten grammar allows exactly the tokens the original allows, step by
step along random documents (xgrammar's own masks of the original grammar are the reference), for random
schemas, the GPU benchmark's schema, regexes, user EBNF and a reasoning model's thinking before a schema."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xgrammar as xgr

from pagedserve.common.grammar_chains import MAX_CHAIN_RULES, chain_bounded_repeats, chain_text
from pagedserve.common.grammars import compile_grammar, grammar_of
from pagedserve.common.sampling_params import StructuredOutput
from tests.structured_schemas import random_schema

BENCH_SCHEMA = (Path(__file__).parents[1] / "scripts" / "bench_schema.json").read_text()


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> tuple[xgr.GrammarCompiler, int, int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    eos = tokenizer.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=[eos])
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False), len(tokenizer), eos


def assert_same_masks(
    compiler: tuple[xgr.GrammarCompiler, int, int], grammar: xgr.Grammar, seed: int, rows: int = 6
) -> None:
    """Walks `rows` random documents (each token drawn among those allowed, EOS only when alone) through
    matchers of `grammar` and of its rewrite side by side: every mask, every accept and every end agree."""
    comp, vocab_size, eos = compiler
    plain, chained = comp.compile_grammar(grammar), comp.compile_grammar(chain_bounded_repeats(grammar))
    rng = np.random.default_rng(seed)
    masks = xgr.allocate_token_bitmask(2, vocab_size)
    for _ in range(rows):
        a, b = xgr.GrammarMatcher(plain), xgr.GrammarMatcher(chained)
        for _ in range(80):
            a.fill_next_token_bitmask(masks, 0)
            b.fill_next_token_bitmask(masks, 1)
            assert torch_equal(masks[0], masks[1])
            bits = np.unpackbits(masks[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
            allowed = np.flatnonzero(bits)
            if len(allowed) > 1:
                allowed = allowed[allowed != eos]
            token = int(rng.choice(allowed))
            assert a.accept_token(token) and b.accept_token(token)
            assert a.is_terminated() == b.is_terminated()
            if a.is_terminated():
                break
        # a token the original refuses, the rewrite refuses too
        if not a.is_terminated():
            a.fill_next_token_bitmask(masks, 0)
            bits = np.unpackbits(masks[0].numpy().view(np.uint8), bitorder="little")[:vocab_size]
            refused = np.flatnonzero(bits == 0)
            for token in rng.choice(refused, size=min(8, len(refused)), replace=False).tolist():
                assert a.accept_token(int(token)) == b.accept_token(int(token)) == False  # noqa: E712


def torch_equal(x: Any, y: Any) -> bool:
    return bool((x == y).all())


def test_bounded_strings_become_chains_of_rules() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 5}}}
    text = chain_text(str(xgr.Grammar.from_json_schema(json.dumps(schema))))
    assert "{2, 5}" not in text
    assert '_then_0_3 ::= ("\\"" | (' in text and "_then_0_4" not in text  # 2 required, 3 optional
    # unbounded repetitions stay (xgrammar's own lookahead serves them)
    assert "{0, -1}" in text and "{1, -1}" in text


def test_same_masks_over_random_schemas(compiler: Any) -> None:
    rng = random.Random(7)
    for seed in range(30):
        schema = random_schema(rng)
        for any_whitespace in (False, True):
            structured = StructuredOutput("json_schema", json.dumps(schema), any_whitespace=any_whitespace)
            assert_same_masks(compiler, grammar_of(structured), seed, rows=3)


@pytest.mark.parametrize(
    "structured",
    [
        StructuredOutput("json_schema", BENCH_SCHEMA),
        StructuredOutput("json_schema", BENCH_SCHEMA, any_whitespace=False),
        StructuredOutput("regex", '[a-z ]{0,12}"[0-9]{1,3}x'),
        StructuredOutput("grammar", 'root ::= item{2, 6} "!" | item{0, 3} "?"\nitem ::= [a-c] | "ab"'),
        StructuredOutput("json_schema", BENCH_SCHEMA, reasoning_begin="<think>", reasoning_end="</think>"),
    ],
    ids=["bench-schema", "bench-schema-compact", "regex", "ebnf", "reasoning"],
)
def test_same_masks(compiler: Any, structured: StructuredOutput) -> None:
    grammar = grammar_of(structured)
    assert str(chain_bounded_repeats(grammar)) != str(grammar)  # something was rewritten
    assert_same_masks(compiler, grammar, seed=1)


def test_the_worker_compiles_the_chains(compiler: Any) -> None:
    compiled = compile_grammar(compiler[0], StructuredOutput("json_schema", BENCH_SCHEMA))
    matcher = xgr.GrammarMatcher(compiled)
    assert matcher.accept_string('{"title": "' + "x" * 40 + '"')
    assert not xgr.GrammarMatcher(compiled).accept_string('{"title": "' + "x" * 41)


def test_long_repetitions_stay_within_the_rule_budget() -> None:
    for schema in (
        {"type": "string", "maxLength": MAX_CHAIN_RULES + 5},
        {"type": "string", "minLength": MAX_CHAIN_RULES, "maxLength": MAX_CHAIN_RULES + 1},
    ):
        text = str(xgr.Grammar.from_json_schema(json.dumps(schema)))
        assert chain_text(text) == text
    # two strings of 200: the first is chained, the second would pass the budget and stays
    props = {name: {"type": "string", "maxLength": 200} for name in ("a", "b")}
    schema = {"type": "object", "properties": props, "required": ["a", "b"]}
    text = chain_text(str(xgr.Grammar.from_json_schema(json.dumps(schema))))
    assert text.count("{0, 200}") == 1 and len(re.findall(r"^\S+_then_0_\d+ ::=", text, re.M)) == 201


def test_new_rules_do_not_clash_with_the_grammars_names(compiler: Any) -> None:
    ebnf = 'root ::= a{0, 3} "x" a_then_0_2\na ::= "a"\na_then_0_2 ::= "b"'
    grammar = xgr.Grammar.from_ebnf(ebnf)
    text = chain_text(str(grammar))
    assert text.count("a_then_0_2 ::=") == 1
    assert_same_masks(compiler, grammar, seed=2, rows=4)


def test_a_text_that_does_not_read_back_leaves_the_grammar(monkeypatch: pytest.MonkeyPatch) -> None:
    grammar = xgr.Grammar.from_regex('a{0,4}"')

    def refuse(*args: Any, **kwargs: Any) -> xgr.Grammar:
        raise RuntimeError("unreadable")

    monkeypatch.setattr(xgr.Grammar, "from_ebnf", refuse)
    assert chain_bounded_repeats(grammar) is grammar
