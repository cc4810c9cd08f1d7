"""Tool-call and reasoning parsers on whole texts and on the same texts streamed in pieces split anywhere:
the streamed deltas, accumulated as the openai client accumulates them, give the same calls and content as
the whole text, and both give back the calls the text was written from (json.loads is the reference)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.api.reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from pagedserve.api.tool_parsers import TOOL_PARSERS, NamedToolParser, RequiredToolParser, ToolParser

NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,12}", fullmatch=True)
TEXT = st.text(st.sampled_from(list('ab "\\}{][:,<>/\n\té🙂') + ["\u2028"]), max_size=12)
SCALARS = st.none() | st.booleans() | st.integers(-(10**6), 10**6) | st.floats(-1e6, 1e6) | TEXT
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8,
)
ARGUMENTS = st.dictionaries(TEXT, JSON_VALUES, max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3)
# Content before the calls: never holding the markers themselves
CONTENT = st.text(st.sampled_from(list("ab {}<>[]/\n🙂_")), max_size=20).filter(
    lambda t: "<tool_call>" not in t and "[TOOL_CALLS]" not in t
)


def dumps(value: Any, compact: bool) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":") if compact else None)


def hermes_text(content: str, calls: list[tuple[str, dict]], compact: bool) -> str:
    blocks = [f"<tool_call>\n{dumps({'name': n, 'arguments': a}, compact)}\n</tool_call>" for n, a in calls]
    return content + "\n".join(blocks)


def llama3_text(content: str, calls: list[tuple[str, dict]], compact: bool) -> str:
    return "; ".join(dumps({"name": n, "parameters": a}, compact) for n, a in calls)


def mistral_text(content: str, calls: list[tuple[str, dict]], compact: bool) -> str:
    if compact:  # the v11+ form
        return content + "".join(f"[TOOL_CALLS]{n}[ARGS]{dumps(a, True)}" for n, a in calls)
    return content + "[TOOL_CALLS]" + dumps([{"name": n, "arguments": a} for n, a in calls], False)


FORMATS = {"hermes": hermes_text, "llama3_json": llama3_text, "mistral": mistral_text}


def accumulate(parser: ToolParser, pieces: list[str]) -> tuple[str, list[dict[str, Any]]]:
    """The content and calls of a stream, put together as the openai client does (by index: id, type and
    name from the first entry, arguments concatenated), checking each entry's shape on the way."""
    content = ""
    calls: dict[int, dict[str, Any]] = {}
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for delta in deltas:
        content += delta.content
        indices = [e["index"] for e in delta.tool_calls]
        assert len(indices) == len(set(indices))  # one entry per call in a chunk
        for entry in delta.tool_calls:
            index = entry["index"]
            if index not in calls:
                assert index == len(calls)  # calls start in order
                assert entry["type"] == "function" and entry["id"] and entry["function"]["name"]
                calls[index] = {"id": entry["id"], "name": entry["function"]["name"], "arguments": ""}
            else:
                assert "id" not in entry and "name" not in entry["function"]  # sent once
            calls[index]["arguments"] += entry["function"].get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


def check_whole(parser: ToolParser, text: str, content: str | None, calls: list[tuple[str, dict]]) -> None:
    found_content, found = parser.extract(text)
    assert found_content == content
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls
    assert len({c.id for c in found}) == len(found)


def check_stream(
    make: Any, text: str, content: str | None, calls: list[tuple[str, dict]], cuts: list[int]
) -> None:
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    streamed_content, streamed = accumulate(make(), pieces)
    assert streamed_content == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("compact", [False, True])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=CONTENT, calls=CALLS, data=st.data())
def test_calls_parse_whole_and_streamed_at_random_splits(
    fmt: str, compact: bool, content: str, calls: list[tuple[str, dict]], data: st.DataObject
) -> None:
    content = "" if fmt == "llama3_json" else content  # Llama 3 writes calls alone
    text = FORMATS[fmt](content, calls, compact)
    make = TOOL_PARSERS[fmt]
    check_whole(make(), text, content or None, calls)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    check_stream(make, text, content or None, calls, cuts)
    check_stream(make, text, content or None, calls, list(range(len(text))))  # one character at a time


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_every_single_split_point(fmt: str) -> None:
    calls = [
        ("get_weather", {"city": 'Pa"ris}', "days": [1, 2.5, None], "x": {"y": "<tool_call>"}}),
        ("b", {}),
    ]
    content = "" if fmt == "llama3_json" else "Let me check. "
    for compact in (False, True):
        text = FORMATS[fmt](content, calls, compact)
        for cut in range(len(text) + 1):
            check_stream(TOOL_PARSERS[fmt], text, content or None, calls, [cut])


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("hermes", "Just text, with a <tool but no call."),
        ("hermes", "<tool_call>\n{not json}\n</tool_call>"),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": 1}\n'),  # truncated
        ("llama3_json", "The answer is {probably} 4."),
        ("llama3_json", '{"parameters": {"a": 1}}'),  # no name
        ("mistral", "Nothing to call [TOOL"),
        ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": [1]}]'),  # arguments not an object
    ],
)
def test_texts_without_valid_calls_are_content(fmt: str, text: str) -> None:
    assert TOOL_PARSERS[fmt]().extract(text) == (text, [])


def test_hermes_blocks_after_text_between_them_count() -> None:
    """vLLM's hermes parser finds every block in the text: a block after text that follows the first one is a
    call too (whole and at every split point); the text between and after is dropped."""
    text = (
        'Checking. <tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\nand also\n'
        '<tool_call>{"name": "b", "arguments": {}}</tool_call> done, <tool_call>{"name": "c", "arguments": {'
    )
    calls = [("a", {"x": 1}), ("b", {})]
    check_whole(TOOL_PARSERS["hermes"](), text + '"y": [2]}}', "Checking. ", [*calls, ("c", {"y": [2]})])
    for cut in range(len(text) + 1):
        check_stream(TOOL_PARSERS["hermes"], text + "}}", "Checking. ", [*calls, ("c", {})], [cut])
    # a malformed later block makes the whole text content, as a malformed first one does (and vLLM)
    broken = '<tool_call>{"name": "a", "arguments": {}}</tool_call> x <tool_call>{bad}</tool_call>'
    assert TOOL_PARSERS["hermes"]().extract(broken) == (broken, [])


def test_llama3_python_tag_and_arguments_as_a_json_string() -> None:
    parser = TOOL_PARSERS["llama3_json"]()
    content, [call] = parser.extract('<|python_tag|>{"name": "f", "arguments": "{\\"a\\": [1]}"}')
    assert content is None and call.name == "f" and json.loads(call.arguments) == {"a": [1]}
    streamed_content, [streamed] = accumulate(
        TOOL_PARSERS["llama3_json"](), list('{"name": "f", "arguments": "{}"}')
    )
    assert streamed_content == "" and streamed["arguments"] == "{}"


def test_ids_have_vllms_form_and_mistrals() -> None:
    [call] = TOOL_PARSERS["hermes"]().extract('<tool_call>{"name": "f", "arguments": {}}</tool_call>')[1]
    assert re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)
    [call] = TOOL_PARSERS["mistral"]().extract('[TOOL_CALLS]f[ARGS]{"a": 1}')[1]
    assert re.fullmatch(r"[A-Za-z0-9]{9}", call.id)


@settings(max_examples=60, deadline=None)
@given(calls=CALLS, compact=st.booleans(), data=st.data())
def test_required_output_is_an_array_of_calls(
    calls: list[tuple[str, dict]], compact: bool, data: st.DataObject
) -> None:
    text = dumps([{"name": n, "parameters": a} for n, a in calls], compact)
    check_whole(RequiredToolParser(), text, None, calls)
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    check_stream(RequiredToolParser, text, None, calls, cuts)


@settings(max_examples=60, deadline=None)
@given(arguments=ARGUMENTS, data=st.data())
def test_named_function_output_is_its_arguments(arguments: dict, data: st.DataObject) -> None:
    text = " " + dumps(arguments, False)
    check_whole(NamedToolParser("f"), text, None, [("f", arguments)])
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    check_stream(lambda: NamedToolParser("f"), text, None, [("f", arguments)], cuts)


REASONING = st.text(st.sampled_from(list("ab <>/think\n🙂")), max_size=30).filter(
    lambda t: "</think>" not in t and "<think>" not in t
)


@settings(max_examples=100, deadline=None)
@given(reasoning=REASONING, content=REASONING, opened=st.booleans(), data=st.data())
def test_reasoning_splits_whole_and_streamed(
    reasoning: str, content: str, opened: bool, data: st.DataObject
) -> None:
    cases = [
        (DeepSeekR1ReasoningParser, False, ("<think>" if opened else "") + f"{reasoning}</think>{content}"),
        (Qwen3ReasoningParser, False, f"<think>{reasoning}</think>{content}"),
        (Qwen3ReasoningParser, True, f"{reasoning}</think>{content}"),
    ]
    for parser_cls, prompt_opens, text in cases:
        whole = parser_cls(prompt_opens_reasoning=prompt_opens).extract(text)
        assert whole == (reasoning or None, content or None)
        cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=8))))
        bounds = [0, *cuts, len(text)]
        parser = parser_cls(prompt_opens_reasoning=prompt_opens)
        parts = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)] + [
            parser.feed("", True)
        ]
        assert "".join(p.reasoning for p in parts) == reasoning
        assert "".join(p.content for p in parts) == content


def test_reasoning_edge_cases() -> None:
    assert DeepSeekR1ReasoningParser().extract("no end tag") == ("no end tag", None)  # all reasoning, as vLLM
    assert Qwen3ReasoningParser().extract("plain answer") == (None, "plain answer")  # thinking off
    assert Qwen3ReasoningParser().extract("  <thin") == (None, "  <thin")
