"""The client library's text options: include_stop_str_in_output in the stop checker (against a whole-text
search), skip_special_tokens / spaces_between_special_tokens against the tokenizer's own decode, and the
prompt logprobs a request gathers, refused out of order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.client import ScoredPrompt
from pagedserve.client.detokenizer import SequenceText, StopChecker
from pagedserve.common.messages import PromptLogprobs, TokenLogprobs


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abS T🙂", max_size=5), max_size=12),
    stops=st.lists(st.text(alphabet="abST🙂", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_included_stop_string_ends_the_text_as_a_whole_text_search_says(
    pieces: list[str], stops: list[str]
) -> None:
    text = "".join(pieces)
    hits = sorted((i, len(s)) for s in stops if (i := text.find(s)) >= 0)
    expected = text[: hits[0][0] + hits[0][1]] if hits else text
    checker = StopChecker(stops, include_stop_str=True)
    assert "".join(checker.push(p) for p in pieces) + checker.flush() == expected
    assert checker.stopped == bool(hits)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    words=st.lists(st.sampled_from([" one", "two", "日本", "🙂", "<S>", "<E>", "\n"]), max_size=12),
    skip=st.booleans(),
    spaces=st.booleans(),
    chunk=st.integers(1, 3),
)
def test_streamed_text_equals_the_tokenizers_decode_with_the_same_options(
    tokenizer: Any, words: list[str], skip: bool, spaces: bool, chunk: int
) -> None:
    special_ids = tokenizer.convert_tokens_to_ids(["<|begin_of_text|>", "<|eot_id|>"])
    specials = dict(zip(("<S>", "<E>"), special_ids, strict=True))
    ids: list[int] = []
    for w in words:
        ids += [specials[w]] if w in specials else tokenizer.encode(w, add_special_tokens=False)
    text = SequenceText(tokenizer, skip_special_tokens=skip, spaces_between_special_tokens=spaces)
    streamed = "".join(text.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)) + text.finish()
    expected = tokenizer.decode(
        ids,
        skip_special_tokens=skip,
        spaces_between_special_tokens=spaces,
        clean_up_tokenization_spaces=False,
    )
    assert streamed == expected


def test_scored_prompt_takes_chunks_in_order_only() -> None:
    scored = ScoredPrompt()
    scored.add(PromptLogprobs(1, [TokenLogprobs(-1.0)] * 2, [1, 3]))
    scored.add(PromptLogprobs(3, [TokenLogprobs(-2.0)], [2]))
    assert len(scored) == 3 and scored.ranks == [1, 3, 2]
    with pytest.raises(ValueError):
        scored.add(PromptLogprobs(5, [TokenLogprobs(-1.0)], [1]))  # position 4 is missing
