"""common/grammars.py against the tiny checkpoint's tokenizer, compiled as the worker compiles them: Lark
grammars (vLLM takes them beside EBNF) and a reasoning model's free thinking before the constraint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from pagedserve.common.grammars import GrammarError, compile_grammar, grammar_of, is_lark
from pagedserve.common.sampling_params import StructuredOutput


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def accepts(tokenizer: Any, structured: StructuredOutput, text: str) -> bool:
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, stop_token_ids=[tokenizer.eos_token_id])
    matcher = xgr.GrammarMatcher(compile_grammar(xgr.GrammarCompiler(info), structured))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(tokenizer.eos_token_id)


def test_lark_grammars_are_told_from_ebnf_and_compiled(tokenizer: Any) -> None:
    lark = 'start: item ("," item)*\n?item: WORD | NUMBER\nWORD: /[a-z]+/\nNUMBER: /[0-9]+/\n'
    assert is_lark(lark) and not is_lark('root ::= "a" | b\nb ::= "c"')
    structured = StructuredOutput("grammar", lark)
    assert accepts(tokenizer, structured, "abc,12,x")
    assert not accepts(tokenizer, structured, "abc,,12")
    assert not accepts(tokenizer, structured, "ABC")
    with pytest.raises(GrammarError):
        grammar_of(StructuredOutput("grammar", "start: undefined_rule\n"))


@pytest.mark.parametrize("begin", ["", "<think>"])
def test_thinking_is_free_until_its_end_then_the_constraint_holds(tokenizer: Any, begin: str) -> None:
    structured = StructuredOutput("regex", "[0-9]{2}", reasoning_begin=begin, reasoning_end="</think>")
    assert accepts(tokenizer, structured, f"{begin}Any text: {{}} <b> 7?</think>\n42")
    assert accepts(tokenizer, structured, f"{begin}</think>42")  # empty thinking
    assert not accepts(tokenizer, structured, "42")  # the thinking must end first
    assert not accepts(tokenizer, structured, f"{begin}x</think>4")  # then the constraint holds
    assert not accepts(tokenizer, structured, f"{begin}x</think>\n\n\n\n\n42")  # at most 4 blank characters
    assert StructuredOutput("regex", "a", reasoning_begin="<think>").validate() is not None
