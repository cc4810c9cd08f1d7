"""/v1/messages through the official anthropic client: text with thinking, the event stream, tool_use and
tool_result round trips, stop sequences, count_tokens, the API key in x-api-key, and errors in Anthropic's
shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest

from pagedserve.api.messages.request import COUNT_TOKENS_FIELDS, MESSAGES_FIELDS
from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer
from tests.api.translated import WEATHER_SCHEMA, ScriptedServer, scripted_server, sse_events, tool_call_text

TOOLS = [{"name": "get_weather", "description": "The weather", "input_schema": WEATHER_SCHEMA}]
USER = [{"role": "user", "content": "Hi!"}]
REPO = Path(__file__).resolve().parents[2]
KEY = "sk-messages-test"


@pytest.fixture(scope="module")
def hermes(tiny_model_dir: Path, tmp_path_factory: Any) -> Iterator[ScriptedServer]:
    config = ApiConfig(
        enable_auto_tool_choice=True, tool_call_parser="hermes", reasoning_parser="qwen3", api_key=KEY
    )
    yield from scripted_server(tiny_model_dir, tmp_path_factory.mktemp("messages"), config)


@pytest.fixture(scope="module")
def client(hermes: ScriptedServer) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=hermes.server.base_url, api_key=KEY, max_retries=0, timeout=30) as c:
        yield c


def test_text_with_thinking_and_system(hermes: ScriptedServer, client: anthropic.Anthropic) -> None:
    hermes.script("Mulling.</think>Hello there.")
    reply = client.messages.create(model="tiny-llama", max_tokens=100, system="Be terse.", messages=USER)
    assert reply.type == "message" and reply.role == "assistant" and reply.id.startswith("msg_")
    thinking, text = reply.content
    assert thinking.type == "thinking" and thinking.thinking == "Mulling."
    assert text.type == "text" and text.text == "Hello there."
    assert reply.stop_reason == "end_turn" and reply.stop_sequence is None
    prompt = hermes.last_prompt()
    assert "<|im_start|>system\nBe terse.<|im_end|>" in prompt and "<|im_start|>user\nHi!<|im_end|>" in prompt
    submitted = hermes.server.fake.submits()[-1]
    assert submitted.params.max_tokens == 100
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) == len(
        submitted.prompt_token_ids
    )
    assert reply.usage.output_tokens == len(hermes.tokenizer("Mulling.</think>Hello there.")["input_ids"])


def test_the_stream_has_anthropics_events(hermes: ScriptedServer, client: anthropic.Anthropic) -> None:
    hermes.script("Hmm.</think>Hello there, streamed.")
    body = {"model": "tiny-llama", "max_tokens": 100, "messages": USER, "stream": True}
    reply = hermes.server.post("/v1/messages", body, headers={"x-api-key": KEY})
    assert reply.status == 200 and reply.content_type.startswith("text/event-stream")
    events = sse_events(reply.text)
    assert all(name == data["type"] for name, data in events)
    kinds = [data["type"] for _, data in events]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    block = ["content_block_start", "content_block_delta", "content_block_stop"]
    assert squeezed == ["message_start", "ping", *block, *block, "message_delta", "message_stop"]
    deltas = [d["delta"]["type"] for _, d in events if d["type"] == "content_block_delta"]
    assert set(deltas[:1]) == {"thinking_delta"} and deltas[-1] == "text_delta"
    assert events[-2][1]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}

    with client.messages.stream(model="tiny-llama", max_tokens=100, messages=USER) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "Hello there, streamed." and final.content[-1].text == text  # type: ignore[union-attr]
    assert final.stop_reason == "end_turn" and final.usage.output_tokens > 0


def test_a_tool_use_round_trip(hermes: ScriptedServer, client: anthropic.Anthropic) -> None:
    hermes.script(
        "Tool time.</think>Let me look." + tool_call_text("get_weather", {"city": "Paris", "days": 2})
    )
    first = client.messages.create(model="tiny-llama", max_tokens=300, messages=USER, tools=TOOLS)
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "text", "tool_use"]
    use = first.content[2]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris", "days": 2}

    hermes.script("Done.</think>It is sunny.")
    result = {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21C"}
    history = [*USER, {"role": "assistant", "content": first.content}, {"role": "user", "content": [result]}]
    second = client.messages.create(model="tiny-llama", max_tokens=300, messages=history, tools=TOOLS)
    assert second.content[-1].text == "It is sunny."  # type: ignore[union-attr]
    prompt = hermes.last_prompt()
    assert (
        prompt.index("Hi!") < prompt.index('<tool_call>\n{"name": "get_weather"') < prompt.index("sunny, 21C")
    )
    assert "<think>Tool time.</think>" in prompt and '"days": 2' in prompt

    hermes.script('x</think>{"city": "Oslo"}')  # a named tool: the output is held to its arguments' schema
    choice = {"type": "tool", "name": "get_weather"}
    with client.messages.stream(
        model="tiny-llama", max_tokens=300, messages=USER, tools=TOOLS, tool_choice=choice
    ) as stream:
        kinds = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert "input_json_delta" in kinds
    assert final.stop_reason == "tool_use" and final.content[-1].input == {"city": "Oslo"}  # type: ignore[union-attr]
    structured = hermes.server.fake.submits()[-1].params.structured
    assert structured is not None and json.loads(structured.spec) == WEATHER_SCHEMA  # the named tool's


def test_a_stop_sequence_is_reported(hermes: ScriptedServer, client: anthropic.Anthropic) -> None:
    hermes.script("x</think>one two STOP three")
    reply = client.messages.create(model="tiny-llama", max_tokens=100, messages=USER, stop_sequences=["STOP"])
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "STOP"
    assert reply.content[-1].text == "one two "  # type: ignore[union-attr]


def test_a_final_assistant_text_is_continued(hermes: ScriptedServer, client: anthropic.Anthropic) -> None:
    hermes.script(" blue.")
    prefill = [*USER, {"role": "assistant", "content": "</think>The sky is"}]
    reply = client.messages.create(model="tiny-llama", max_tokens=20, messages=prefill)
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text == " blue."  # type: ignore[union-attr]
    assert hermes.last_prompt().endswith("<|im_start|>assistant</think>The sky is")


def test_count_tokens_is_the_rendered_prompts(hermes: ScriptedServer, client: anthropic.Anthropic) -> None:
    counted = client.messages.count_tokens(model="tiny-llama", system="Be terse.", messages=USER, tools=TOOLS)
    hermes.script("x</think>ok")
    client.messages.create(model="tiny-llama", max_tokens=10, system="Be terse.", messages=USER, tools=TOOLS)
    assert counted.input_tokens == len(hermes.server.fake.submits()[-1].prompt_token_ids)


def test_the_key_is_needed_in_x_api_key_or_bearer(hermes: ScriptedServer) -> None:
    body = {"model": "tiny-llama", "max_tokens": 5, "messages": USER}
    hermes.script("x</think>ok")
    missing = hermes.server.post("/v1/messages", body)
    assert missing.status == 401 and missing.json()["error"]["type"] == "authentication_error"
    wrong = hermes.server.post("/v1/messages/count_tokens", body, headers={"x-api-key": "nope"})
    assert wrong.status == 401 and wrong.json()["type"] == "error"
    assert hermes.server.post("/v1/messages", body, headers={"Authorization": f"Bearer {KEY}"}).status == 200
    versioned = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    assert hermes.server.post("/v1/messages", body, headers=versioned).status == 200
    with anthropic.Anthropic(base_url=hermes.server.base_url, api_key="nope", max_retries=0) as c:
        with pytest.raises(anthropic.AuthenticationError):
            c.messages.create(model="tiny-llama", max_tokens=5, messages=USER)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 1.5}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"top_k": -3}, "top_k"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": ""}]}]},
            "messages",
        ),
        ({"stop_sequences": ["x"] * 100}, "stop_sequences"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools"),
        ({"tools": [{"name": "bad name!", "input_schema": WEATHER_SCHEMA}]}, "tools"),
        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "thinking"),
        ({"thinking": {"type": "enabled", "budget_tokens": 4096}}, "thinking"),  # not under max_tokens
        ({"mcp_servers": [{"url": "x"}]}, "mcp_servers"),
        ({"model": "claude-opus"}, "claude-opus"),
    ],
)
def test_bad_requests_get_anthropics_error_shape(
    hermes: ScriptedServer, client: anthropic.Anthropic, fields: dict[str, Any], fragment: str
) -> None:
    body = {"model": "tiny-llama", "max_tokens": 100, "messages": USER, **fields}
    before = len(hermes.server.fake.submits())
    reply = hermes.server.post(
        "/v1/messages", {k: v for k, v in body.items() if v is not None}, {"x-api-key": KEY}
    )
    assert reply.status in (400, 404), reply.text
    error = reply.json()
    assert set(error) == {"type", "error"} and error["type"] == "error"
    kind = "invalid_request_error" if reply.status == 400 else "not_found_error"
    assert error["error"]["type"] == kind and fragment in error["error"]["message"]
    assert len(hermes.server.fake.submits()) == before


def test_the_client_sees_typed_errors(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="tiny-llama", max_tokens=10**9, messages=USER)
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=5, messages=USER)


def test_unknown_paths_under_messages_answer_in_anthropics_shape(server: ApiServer) -> None:
    reply = server.post("/v1/messages/nope", {})
    assert reply.status == 404 and reply.json()["error"]["type"] == "not_found_error"


def test_every_field_is_in_the_endpoints_page() -> None:
    text = (REPO / "docs" / "api" / "messages.md").read_text()
    missing = sorted(name for name in MESSAGES_FIELDS | COUNT_TOKENS_FIELDS if f"`{name}`" not in text)
    assert not missing


def test_sampling_fields_reach_the_scheduler(hermes: ScriptedServer, client: anthropic.Anthropic) -> None:
    hermes.script("x</think>ok")
    sampling = {"temperature": 0.5, "top_p": 0.9, "top_k": 40}
    client.messages.create(model="tiny-llama", max_tokens=7, messages=USER, extra_body=sampling)
    params = hermes.server.fake.submits()[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.5, 0.9, 40, 7)
    client.messages.create(model="tiny-llama", max_tokens=7, messages=USER, thinking={"type": "disabled"})
    assert hermes.last_prompt().endswith("<think>\n\n</think>")  # the template's enable_thinking false
