"""The parsers of qwen3_coder, glm45, deepseek_v31, kimi_k2 and gpt-oss's harmony (`openai`), on the formats'
real strings (as the models' chat templates write them and the models emit them) and on generated calls,
whole and streamed at random split points, accumulated as the openai client does (test_tool_parsers.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.api.tool_parsers import TOOL_PARSERS
from tests.api.test_tool_parsers import CONTENT, JSON_VALUES, NAMES, accumulate, dumps

KEYS = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
ARGUMENTS = st.dictionaries(KEYS, JSON_VALUES, max_size=4)
CALLS = st.lists(st.tuples(NAMES, ARGUMENTS), min_size=1, max_size=3, unique_by=lambda c: c[0])
SEP = "<｜tool▁sep｜>"


def raw(value: Any) -> str:
    """A value as the XML-style templates write it: a string as itself, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def qwen3_coder_text(content: str, calls: list[tuple[str, dict]], compact: bool) -> str:
    gap = "" if compact else "\n"
    blocks = [
        f"<tool_call>{gap}<function={n}>{gap}"
        + "".join(f"<parameter={k}>\n{raw(v)}\n</parameter>{gap}" for k, v in a.items())
        + f"</function>{gap}</tool_call>"
        for n, a in calls
    ]
    return content + gap.join(blocks)


def glm45_text(content: str, calls: list[tuple[str, dict]], compact: bool) -> str:
    gap = "" if compact else "\n"  # GLM-4.7 writes no newlines, 4.5 and 4.6 do
    blocks = [
        f"<tool_call>{n}{gap}"
        + "".join(f"<arg_key>{k}</arg_key>{gap}<arg_value>{raw(v)}</arg_value>{gap}" for k, v in a.items())
        + "</tool_call>"
        for n, a in calls
    ]
    return content + gap.join(blocks)


def deepseek_v31_text(content: str, calls: list[tuple[str, dict]], compact: bool) -> str:
    return (
        content
        + "<｜tool▁calls▁begin｜>"
        + "".join(f"<｜tool▁call▁begin｜>{n}{SEP}{dumps(a, compact)}<｜tool▁call▁end｜>" for n, a in calls)
        + "<｜tool▁calls▁end｜>"
    )


def kimi_k2_text(content: str, calls: list[tuple[str, dict]], compact: bool) -> str:
    return (
        content
        + "<|tool_calls_section_begin|>"
        + "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{dumps(a, compact)}"
            "<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        )
        + "<|tool_calls_section_end|>"
    )


def harmony_text(content: str, calls: list[tuple[str, dict]], compact: bool) -> str:
    """Reasoning, then the answer (the final channel, when there is content), then the calls: addressed in
    the channel part or (compact) in the role part; the last `<|call|>` (a stop token) left off if compact."""
    text = "<|channel|>analysis<|message|>The user wants a call: {maybe} <tool>.<|end|>"
    if content:
        text += f"<|start|>assistant<|channel|>final<|message|>{content}<|end|>"
    for i, (n, a) in enumerate(calls):
        if compact:
            head = f"<|start|>assistant to=functions.{n}<|channel|>commentary json"
        else:
            head = f"<|start|>assistant<|channel|>commentary to=functions.{n} <|constrain|>json"
        end = "" if compact and i == len(calls) - 1 else "<|call|>"
        text += f"{head}<|message|>{dumps(a, compact)}{end}"
    return text


FORMATS = {
    "qwen3_coder": qwen3_coder_text,
    "glm45": glm45_text,
    "deepseek_v31": deepseek_v31_text,
    "kimi_k2": kimi_k2_text,
    "openai": harmony_text,
}


def tools_for(calls: list[tuple[str, dict]]) -> list[dict[str, Any]]:
    """The request's tools that the calls were written for: string parameters typed as strings."""
    return [
        {
            "type": "function",
            "function": {
                "name": n,
                "parameters": {
                    "type": "object",
                    "properties": {k: {"type": "string"} if isinstance(v, str) else {} for k, v in a.items()},
                },
            },
        }
        for n, a in calls
    ]


def check(fmt: str, text: str, content: str | None, calls: list[tuple[str, dict]], cuts: list[int]) -> None:
    """Whole and streamed at `cuts`: the same content and the calls the text was written from."""
    tools = tools_for(calls)
    found_content, found = TOOL_PARSERS[fmt](tools=tools).extract(text)
    assert found_content == content
    assert [(c.name, json.loads(c.arguments)) for c in found] == calls
    assert len({c.id for c in found}) == len(found)
    bounds = [0, *sorted(set(cuts)), len(text)]
    pieces = [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]
    streamed_content, streamed = accumulate(TOOL_PARSERS[fmt](tools=tools), pieces)
    assert streamed_content == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("compact", [False, True])
@settings(max_examples=40, deadline=None)
@given(content=CONTENT, calls=CALLS, data=st.data())
def test_calls_parse_whole_and_streamed_at_random_splits(
    fmt: str, compact: bool, content: str, calls: list[tuple[str, dict]], data: st.DataObject
) -> None:
    text = FORMATS[fmt](content, calls, compact)
    check(fmt, text, content or None, calls, data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    check(fmt, text, content or None, calls, list(range(len(text))))  # one character at a time


REAL = {  # the models' own outputs, as their model cards and vLLM's tests show them
    "qwen3_coder": "I'll check.\n<tool_call>\n<function=get_current_weather>\n<parameter=city>\nDallas\n"
    "</parameter>\n<parameter=state>\nTX\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n"
    "</tool_call>",
    "glm45": "I'll check.\n<tool_call>get_current_weather\n<arg_key>city</arg_key>\n<arg_value>Dallas"
    "</arg_value>\n<arg_key>state</arg_key>\n<arg_value>TX</arg_value>\n<arg_key>days</arg_key>\n"
    "<arg_value>3</arg_value>\n</tool_call>",
    "deepseek_v31": "I'll check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_current_weather<｜tool▁sep｜>"
    '{"city": "Dallas", "state": "TX", "days": 3}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": "I'll check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_current_weather:0"
    '<|tool_call_argument_begin|>{"city": "Dallas", "state": "TX", "days": 3}<|tool_call_end|>'
    "<|tool_calls_section_end|>",
    "openai": "<|channel|>analysis<|message|>Need to use function get_current_weather.<|end|><|start|>"
    "assistant<|channel|>final<|message|>I'll check.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_current_weather <|constrain|>json<|message|>{"city":"Dallas","state":"TX","days":3}'
    "<|call|>",
}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_current_weather",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "state": {"type": "string"},
                    "days": {"type": "integer"},
                },
            },
        },
    }
]


@pytest.mark.parametrize("fmt", sorted(REAL))
def test_real_outputs_at_every_split_point(fmt: str) -> None:
    expected = [("get_current_weather", {"city": "Dallas", "state": "TX", "days": 3})]
    text = REAL[fmt]
    content, [call] = TOOL_PARSERS[fmt](tools=WEATHER).extract(text)
    assert content == "I'll check." + ("\n" if fmt in ("qwen3_coder", "glm45") else "")
    assert (call.name, json.loads(call.arguments)) == expected[0]
    for cut in range(len(text) + 1):
        streamed_content, streamed = accumulate(TOOL_PARSERS[fmt](tools=WEATHER), [text[:cut], text[cut:]])
        assert streamed_content == content
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == expected
    if fmt == "kimi_k2":  # the model's own id, which Kimi's template writes back in the next turn
        assert call.id == "functions.get_current_weather:0"


def test_kimi_k2_singular_section_marker_and_newlines() -> None:
    text = "Sure.\n<|tool_call_section_begin|>\n<|tool_call_begin|>functions.get_current_weather:0"
    text += '<|tool_call_argument_begin|>\n{"city": "Oslo"}\n<|tool_call_end|>\n<|tool_calls_section_end|>'
    content, [call] = TOOL_PARSERS["kimi_k2"](tools=WEATHER).extract(text)
    assert content == "Sure.\n" and json.loads(call.arguments) == {"city": "Oslo"}


def test_untyped_values_follow_the_schema() -> None:
    """A string parameter keeps text that looks like JSON; other parameters' text is JSON when it parses."""
    text = "<tool_call>\n<function=f>\n<parameter=s>\n12\n</parameter>\n<parameter=n>\n12\n</parameter>\n"
    text += (
        "<parameter=o>\n{'a': 1}\n</parameter>\n<parameter=b>\nTrue\n</parameter>\n</function>\n</tool_call>"
    )
    props = {
        "s": {"type": "string"},
        "n": {"type": "integer"},
        "o": {"type": "object"},
        "b": {"type": "boolean"},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": props}}}]
    _, [call] = TOOL_PARSERS["qwen3_coder"](tools=tools).extract(text)
    assert json.loads(call.arguments) == {"s": "12", "n": 12, "o": "{'a': 1}", "b": True}


@pytest.mark.parametrize(
    "fmt, text",
    [
        ("qwen3_coder", "Text with <tool_call> but then <function=f>\n<parameter=a>\n1\n"),  # unclosed
        ("qwen3_coder", "<tool_call>\n<fun>oops</fun>\n</tool_call>"),
        ("glm45", "<tool_call>f\n<arg_key>a</arg_key>\n<oops>1</oops></tool_call>"),
        (
            "deepseek_v31",
            "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{bad json}<｜tool▁call▁end｜>",
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>[1]",
        ),
        ("openai", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"a": '),
        ("openai", "Plain text from a model that ignores the format <|call|>"),
    ],
)
def test_texts_without_valid_calls_are_content(fmt: str, text: str) -> None:
    assert TOOL_PARSERS[fmt]().extract(text) == (text, [])


def test_harmony_without_calls_returns_the_final_channel_only() -> None:
    text = "<|channel|>analysis<|message|>thinking<|end|><|start|>assistant<|channel|>final<|message|>Hi!"
    assert TOOL_PARSERS["openai"]().extract(text) == ("Hi!", [])
    assert accumulate(TOOL_PARSERS["openai"](), list(text)) == ("Hi!", [])
