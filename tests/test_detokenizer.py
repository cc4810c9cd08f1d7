"""Incremental detokenization and stop strings against the tiny checkpoint's byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.client.detokenizer import IncrementalDetokenizer, SequenceText, StopChecker, TokenStrings

MULTIBYTE_TEXT = "日本語 🙂 naïve café — ünïcödé, 한국어 and emoji 👩‍💻!"


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _stream(detok: IncrementalDetokenizer, ids: list[int], chunk_sizes: list[int]) -> list[str]:
    pieces, i, sizes = [], 0, iter(chunk_sizes)
    while i < len(ids):
        size = next(sizes, 1)
        pieces.append(detok.push(ids[i : i + size]))
        i += size
    pieces.append(detok.flush())
    return pieces


def test_multibyte_characters_are_never_split(tokenizer: Any) -> None:
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE_TEXT) / 2  # many characters span several byte tokens
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + detok.flush() == MULTIBYTE_TEXT


def test_special_tokens_are_skipped_or_kept(tokenizer: Any) -> None:
    ids = tokenizer.encode("hello", add_special_tokens=True) + [tokenizer.convert_tokens_to_ids("<|eot_id|>")]
    skip = IncrementalDetokenizer(tokenizer)
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(_stream(skip, ids, [])) == "hello"
    assert "".join(_stream(keep, ids, [])) == "<|begin_of_text|>hello<|eot_id|>"


def test_push_decodes_a_bounded_window(tokenizer: Any) -> None:
    calls: list[int] = []

    class Counting:
        def decode(self, ids: list[int], **kwargs: Any) -> str:
            calls.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

    detok = IncrementalDetokenizer(Counting())
    ids = tokenizer.encode("the quick brown fox jumps over the lazy dog " * 20, add_special_tokens=False)
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids)
    assert max(calls) <= 4  # never the whole sequence


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    ids=st.lists(st.integers(0, 4095), max_size=40),
    chunk_sizes=st.lists(st.integers(1, 4), max_size=40),
    skip=st.booleans(),
)
def test_streamed_text_equals_full_decode(
    tokenizer: Any, ids: list[int], chunk_sizes: list[int], skip: bool
) -> None:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
    assert "".join(_stream(detok, ids, chunk_sizes)) == tokenizer.decode(ids, skip_special_tokens=skip)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet=st.sampled_from(list("ab 日本🙂\n")), max_size=30),
    chunk_sizes=st.lists(st.integers(1, 3), max_size=40),
)
def test_multibyte_text_round_trips_through_streaming(
    tokenizer: Any, text: str, chunk_sizes: list[int]
) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = _stream(IncrementalDetokenizer(tokenizer), ids, chunk_sizes)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_stop_checker_finds_stop_split_across_pieces() -> None:
    checker = StopChecker(["STOP", "xyz"])
    emitted = [checker.push(p) for p in ["abc S", "T", "O", "Pdef"]]
    assert "".join(emitted) == "abc "
    assert checker.stopped
    assert checker.push("more") == "" and checker.flush() == ""


def test_stop_checker_picks_the_earliest_stop() -> None:
    assert StopChecker(["long stop", "x"]).push("aa long stop bb x") == "aa "
    assert StopChecker(["long stop", "x"]).push("aa long sto x long stop") == "aa long sto "
    assert StopChecker(["bb", "a"]).push("cabb") == "c"


def test_stop_checker_releases_held_text_when_no_stop_comes() -> None:
    checker = StopChecker(["STOP"])
    assert checker.push("abcST") == "abc"  # "ST" could start "STOP"
    assert checker.push("O") == ""
    assert checker.push("x") == "STOx"
    assert checker.push("S") == ""
    assert checker.flush() == "S"
    assert not checker.stopped


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(st.text(alphabet="abS T🙂", max_size=5), max_size=12),
    stops=st.lists(st.text(alphabet="abST🙂", min_size=1, max_size=3), min_size=1, max_size=3),
)
def test_stop_checker_matches_a_whole_text_search(pieces: list[str], stops: list[str]) -> None:
    text = "".join(pieces)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(hits)] if hits else text
    checker = StopChecker(stops)
    streamed = "".join(checker.push(p) for p in pieces) + checker.flush()
    assert streamed == expected
    assert checker.stopped == bool(hits)


def test_sequence_text_stops_on_a_string_spanning_tokens(tokenizer: Any) -> None:
    ids = tokenizer.encode("def main():\n    return 日本語 done", add_special_tokens=False)
    seq = SequenceText(tokenizer, stop=["本語 d"])
    emitted = ""
    for t in ids:
        emitted += seq.push([t])
        if seq.stopped:
            break
    assert seq.stopped
    assert emitted == "def main():\n    return 日"


def test_sequence_text_finds_a_stop_in_the_flushed_tail(tokenizer: Any) -> None:
    # The sequence ends on half a character: only the final flush shows its U+FFFD, completing the stop.
    ids = (
        tokenizer.encode("xab", add_special_tokens=False)
        + tokenizer.encode("🙂", add_special_tokens=False)[:1]
    )
    seq = SequenceText(tokenizer, stop=["b\ufffd"])
    text = "".join(seq.push([t]) for t in ids)
    assert not seq.stopped
    text += seq.finish()
    assert text == "xa" and seq.stopped


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stop_strings_are_not_looked_for_before_min_tokens(tokenizer: Any, chunk: int) -> None:
    """vLLM's rule: a stop string inside the first min_tokens tokens does not end the sequence; one after
    them does, whether the tokens come one at a time or several per push (speculative steps)."""
    first = tokenizer.encode("stop here, ", add_special_tokens=False)
    ids = first + tokenizer.encode("then stop now", add_special_tokens=False)

    def stream(min_tokens: int) -> tuple[str, bool]:
        seq = SequenceText(tokenizer, stop=["stop"], min_tokens=min_tokens)
        out = ""
        for i in range(0, len(ids), chunk):
            out += seq.push(ids[i : i + chunk])
            if seq.stopped:
                return out, True
        return out + seq.finish(), seq.stopped

    assert stream(0) == ("", True)  # the first "stop" ends it at once
    assert stream(len(first)) == ("stop here, then ", True)  # the first is within min_tokens
    assert stream(len(ids)) == ("stop here, then stop now", False)  # every token within min_tokens


def test_token_strings_give_exact_bytes(tokenizer: Any) -> None:
    strings = TokenStrings(tokenizer)
    ids = tokenizer.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert b"".join(strings.get(t)[1] for t in ids) == MULTIBYTE_TEXT.encode()
    eot = tokenizer.convert_tokens_to_ids("<|eot_id|>")
    assert strings.get(eot) == ("<|eot_id|>", b"<|eot_id|>")
    assert strings.get(10**6) == ("", b"")
