"""/v1/responses and /v1/messages through the real processes on the tiny random model, driven by the openai
and anthropic clients: each answers what /v1/chat/completions answers for the same conversation (greedy),
streamed as not, and a forced tool call holds the random model to the tool's schema."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e

SYSTEM = "Be brief."
QUESTION = "Name a colour."
SCHEMA = {
    "type": "object",
    "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "maximum": 9}},
    "required": ["colour", "count"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def clients(server: Any) -> Iterator[tuple[openai.OpenAI, anthropic.Anthropic, str]]:
    with (
        openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as oa,
        anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300) as an,
    ):
        yield oa, an, oa.models.list().data[0].id


def chat_answer(oa: openai.OpenAI, model: str, max_tokens: int) -> tuple[str, str | None]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
    r = oa.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0)
    return r.choices[0].message.content or "", r.choices[0].finish_reason


def test_responses_and_messages_answer_what_chat_answers(server: Any, clients: Any) -> None:
    oa, an, model = clients
    text, finish = chat_answer(oa, model, 12)
    response = oa.responses.create(
        model=model, instructions=SYSTEM, input=QUESTION, max_output_tokens=12, temperature=0
    )
    assert response.output_text == text
    assert response.status == ("incomplete" if finish == "length" else "completed")
    with oa.responses.stream(
        model=model, instructions=SYSTEM, input=QUESTION, max_output_tokens=12, temperature=0
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(deltas) == text

    messages = [{"role": "user", "content": QUESTION}]
    reply = an.messages.create(
        model=model, system=SYSTEM, messages=messages, max_tokens=12, extra_body={"temperature": 0}
    )
    assert "".join(b.text for b in reply.content if b.type == "text") == text
    assert reply.stop_reason == ("max_tokens" if finish == "length" else "end_turn")
    greedy = {"temperature": 0}  # the anthropic client leaves temperature to extra_body
    with an.messages.stream(
        model=model, system=SYSTEM, messages=messages, max_tokens=12, extra_body=greedy
    ) as s:
        assert "".join(s.text_stream) == text
    counted = an.messages.count_tokens(model=model, system=SYSTEM, messages=messages)
    assert counted.input_tokens == reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
    server.wait_until_idle()


def test_a_forced_tool_holds_the_random_model_to_the_schema(server: Any, clients: Any) -> None:
    """A forced call's arguments are compact JSON held to the tool's schema (a random model given free
    whitespace, as json_schema text formats allow, may spend all its tokens on it)."""
    oa, an, model = clients
    tool = {"type": "function", "name": "pick", "description": "Pick a colour", "parameters": SCHEMA}
    response = oa.responses.create(
        model=model,
        input=QUESTION,
        tools=[tool],
        tool_choice={"type": "function", "name": "pick"},
        max_output_tokens=200,
        temperature=0,
    )
    [call] = [item for item in response.output if item.type == "function_call"]
    assert call.name == "pick" and response.status == "completed"
    jsonschema.validate(json.loads(call.arguments), SCHEMA)

    tools = [{"name": "pick", "description": "Pick a colour", "input_schema": SCHEMA}]
    reply = an.messages.create(
        model=model,
        messages=[{"role": "user", "content": QUESTION}],
        max_tokens=200,
        tools=tools,
        tool_choice={"type": "tool", "name": "pick"},
        extra_body={"temperature": 0},
    )
    [use] = [b for b in reply.content if b.type == "tool_use"]
    assert use.name == "pick" and reply.stop_reason == "tool_use"
    jsonschema.validate(use.input, SCHEMA)
    assert json.loads(call.arguments) == use.input  # the same greedy call, by either API
    server.wait_until_idle()
