"""Tool calls through the api, read by the official openai client, streamed and not, for each parser: the
fake scheduler generates a scripted tool-call text in the model family's format, rendered with a chat
template in that family's style (tests/api/chat_templates.py)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from pagedserve.common.config import ApiConfig
from tests.api.chat_templates import TEMPLATES, checkpoint_with_template
from tests.api.harness import ApiServer
from tests.api.test_tool_parsers import FORMATS

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]
CALLS = [("get_weather", {"city": "Paris 🙂", "days": 3}), ("get_time", {})]
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time?"}]


class ToolServer:
    def __init__(self, fmt: str, server: ApiServer, tokenizer: Any) -> None:
        self.fmt = fmt
        self.server = server
        self.tokenizer = tokenizer
        self.client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=30)

    def script(self, text: str) -> None:
        """The next requests' generated text."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        assert self.tokenizer.decode(ids) == text
        self.server.fake.scripted = tuple(ids)


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def tools_server(request: Any, tiny_model_dir: Path, tmp_path_factory: Any) -> Iterator[ToolServer]:
    from transformers import AutoTokenizer

    fmt = request.param
    root = checkpoint_with_template(tiny_model_dir, tmp_path_factory.mktemp(fmt) / "ckpt", TEMPLATES[fmt])
    config = ApiConfig(enable_auto_tool_choice=True, tool_call_parser=fmt)
    server = ApiServer(str(root), config, max_model_len=2048, num_kv_blocks=1024)
    yield ToolServer(fmt, server, AutoTokenizer.from_pretrained(str(root)))
    server.close()


def expected_content(fmt: str) -> str | None:
    return None if fmt == "llama3_json" else "Let me look. "


def assert_calls(calls: Any, fmt: str, expected: list[tuple[str, dict]] = CALLS) -> None:
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == expected
    assert all(c.type == "function" for c in calls) and len({c.id for c in calls}) == len(calls)
    for call in calls:
        assert len(call.id) == 9 if fmt == "mistral" else call.id.startswith("chatcmpl-tool-")


@pytest.mark.parametrize("compact", [False, True])
def test_auto_tool_calls_reach_the_openai_client(tools_server: ToolServer, compact: bool) -> None:
    fmt = tools_server.fmt
    tools_server.script(FORMATS[fmt](expected_content(fmt) or "", CALLS, compact))
    request = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=400)
    response = tools_server.client.chat.completions.create(**request)
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == expected_content(fmt)
    assert_calls(choice.message.tool_calls, fmt)

    with tools_server.client.chat.completions.stream(**request) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    [choice] = final.choices
    assert choice.finish_reason == "tool_calls"
    assert (choice.message.content or None) == expected_content(fmt)
    assert_calls(choice.message.tool_calls, fmt)
    # The name came once per call, then argument fragments; more than one chunk carried arguments.
    entries = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert sum(e.function is not None and e.function.name is not None for e in entries) == len(CALLS)
    assert sum(bool(e.function and e.function.arguments) for e in entries) > len(CALLS)


def test_tool_choice_none_leaves_the_text_alone(tools_server: ToolServer) -> None:
    text = FORMATS[tools_server.fmt]("", CALLS, False)
    tools_server.script(text)
    response = tools_server.client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=400
    )
    [choice] = response.choices
    assert choice.message.content == text and not choice.message.tool_calls and choice.finish_reason == "stop"


def test_tools_and_history_are_rendered_as_transformers_renders_them(tools_server: ToolServer) -> None:
    """The assistant's tool calls come back as the client sends them (arguments as JSON text), the tool
    results with their ids; the template gets the arguments as objects, as vLLM gives them."""
    fmt = tools_server.fmt
    tools_server.script(FORMATS[fmt](expected_content(fmt) or "", CALLS, False))
    first = tools_server.client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=400
    )
    assistant = first.choices[0].message.model_dump(exclude_none=True)
    results = [
        {"role": "tool", "tool_call_id": c.id, "content": f"result {i}"}
        for i, c in enumerate(first.choices[0].message.tool_calls or [])
    ]
    tools_server.script("It is sunny.")
    history = [{"role": "system", "content": "Be brief."}, *MESSAGES, assistant, *results]
    final = tools_server.client.chat.completions.create(
        model="tiny-llama", messages=history, tools=TOOLS, max_tokens=50
    )
    assert final.choices[0].message.content == "It is sunny." and final.choices[0].finish_reason == "stop"
    expected_assistant = {
        "role": "assistant",
        "content": assistant.get("content"),
        "tool_calls": [
            {
                "id": c["id"],
                "type": "function",
                "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in assistant["tool_calls"]
        ],
    }
    expected = [*history[:2], expected_assistant, *results]
    text = tools_server.tokenizer.apply_chat_template(
        expected, tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    prompt = tools_server.server.fake.submits()[-1].prompt_token_ids
    assert prompt == tools_server.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert '"city": "Paris 🙂"' in text  # written by the template from an object, not a JSON string


def test_parallel_tool_calls_false_keeps_the_first_call(tools_server: ToolServer) -> None:
    fmt = tools_server.fmt
    tools_server.script(FORMATS[fmt](expected_content(fmt) or "", CALLS, False))
    request = dict(
        model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=400, parallel_tool_calls=False
    )
    response = tools_server.client.chat.completions.create(**request)
    assert_calls(response.choices[0].message.tool_calls, fmt, CALLS[:1])
    with tools_server.client.chat.completions.stream(**request) as stream:
        final = stream.get_final_completion()
    assert_calls(final.choices[0].message.tool_calls, fmt, CALLS[:1])


def test_parsers_whose_markers_are_special_tokens_keep_them_in_the_text(tools_server: ToolServer) -> None:
    """hermes' <tool_call> and mistral's [TOOL_CALLS] are special tokens in real tokenizers: under auto, the
    request asks the client not to skip special tokens; under none, and for llama3_json, nothing changes."""
    tools_server.script("Hello.")
    request = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=4)
    tools_server.client.chat.completions.create(**request)
    auto = tools_server.server.fake.submits()[-1].params
    assert auto.skip_special_tokens is (tools_server.fmt not in ("hermes", "mistral"))
    tools_server.client.chat.completions.create(**request, tool_choice="none")
    assert tools_server.server.fake.submits()[-1].params.skip_special_tokens is True


def submitted_schema(server: ApiServer) -> dict[str, Any]:
    structured = server.fake.submits()[-1].params.structured
    assert structured is not None and structured.kind == "json_schema"
    return json.loads(structured.spec)


@pytest.mark.parametrize("stream", [False, True])
def test_required_is_held_to_vllms_schema_and_parsed(tools_server: ToolServer, stream: bool) -> None:
    output = json.dumps([{"name": n, "parameters": a} for n, a in CALLS], ensure_ascii=False)
    tools_server.script(output)
    request = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=400)
    if stream:
        with tools_server.client.chat.completions.stream(**request) as s:
            response = s.get_final_completion()
    else:
        response = tools_server.client.chat.completions.create(**request)
    [choice] = response.choices
    assert_calls(choice.message.tool_calls, "required")
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    schema = submitted_schema(tools_server.server)
    jsonschema.validate(json.loads(output), schema)
    for wrong in (
        [],
        [{"name": "get_weather", "parameters": {"days": 1}}],
        [{"name": "nope", "parameters": {}}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)


def test_required_without_parallel_calls_allows_one(tools_server: ToolServer) -> None:
    tools_server.script('[{"name": "get_time", "parameters": {}}]')
    tools_server.client.chat.completions.create(
        model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice="required", parallel_tool_calls=False
    )
    schema = submitted_schema(tools_server.server)
    jsonschema.validate([{"name": "get_time", "parameters": {}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "parameters": {}}] * 2, schema)


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_is_held_to_its_parameters(tools_server: ToolServer, stream: bool) -> None:
    tools_server.script('{"city": "Oslo", "days": 2}')
    choice_param = {"type": "function", "function": {"name": "get_weather"}}
    request = dict(
        model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice=choice_param, max_tokens=400
    )
    if stream:
        with tools_server.client.chat.completions.stream(**request) as s:
            response = s.get_final_completion()
    else:
        response = tools_server.client.chat.completions.create(**request)
    [choice] = response.choices
    assert_calls(choice.message.tool_calls, "named", [("get_weather", {"city": "Oslo", "days": 2})])
    assert choice.finish_reason == "stop"  # a forced function ends with "stop", as OpenAI's do
    assert submitted_schema(tools_server.server) == TOOLS[0]["function"]["parameters"]


def test_raw_stream_chunks_have_openais_shape(tools_server: ToolServer) -> None:
    fmt = tools_server.fmt
    tools_server.script(FORMATS[fmt]("", CALLS[:1], False))
    events = tools_server.server.stream(
        "/v1/chat/completions", {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 400}
    )
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0]["role"] == "assistant"
    entries = [tc for d in deltas for tc in d.get("tool_calls", [])]
    head = entries[0]
    assert head["index"] == 0 and head["type"] == "function" and head["function"]["name"] == "get_weather"
    assert all(set(e) == {"index", "function"} and set(e["function"]) == {"arguments"} for e in entries[1:])
    assert json.loads("".join(e["function"].get("arguments", "") for e in entries)) == CALLS[0][1]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
