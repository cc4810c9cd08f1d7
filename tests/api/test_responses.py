"""/v1/responses through the official openai client: text with reasoning, the event stream, function calls
and their outputs sent back with previous_response_id, text.format json_schema through `.parse`, and the
400s of fields out of range."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pydantic
import pytest

from pagedserve.api.responses.request import RESPONSES_FIELDS
from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer
from tests.api.test_errors import assert_error
from tests.api.translated import WEATHER_SCHEMA, ScriptedServer, scripted_server, sse_events, tool_call_text

TOOLS = [
    {"type": "function", "name": "get_weather", "description": "The weather", "parameters": WEATHER_SCHEMA}
]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def hermes(tiny_model_dir: Path, tmp_path_factory: Any) -> Iterator[ScriptedServer]:
    yield from scripted_server(tiny_model_dir, tmp_path_factory.mktemp("responses"))


@pytest.fixture(scope="module")
def client(hermes: ScriptedServer) -> Iterator[openai.OpenAI]:
    base = hermes.server.base_url + "/v1"
    with openai.OpenAI(base_url=base, api_key="x", max_retries=0, timeout=30) as c:
        yield c


def test_text_with_reasoning_and_instructions(hermes: ScriptedServer, client: openai.OpenAI) -> None:
    hermes.script("Mulling it over.</think>Hello there.")
    response = client.responses.create(model="tiny-llama", input="Hi!", instructions="Be terse.")
    assert response.status == "completed" and response.object == "response"
    assert response.id.startswith("resp_")
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "Mulling it over."
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.output_text == "Hello there."
    assert response.instructions == "Be terse."
    prompt = hermes.last_prompt()
    assert "<|im_start|>system\nBe terse.<|im_end|>" in prompt and "<|im_start|>user\nHi!<|im_end|>" in prompt
    assert response.usage is not None
    assert response.usage.input_tokens == len(hermes.server.fake.submits()[-1].prompt_token_ids)
    assert response.usage.output_tokens == len(
        hermes.tokenizer("Mulling it over.</think>Hello there.")["input_ids"]
    )


def test_the_stream_is_the_sequence_the_sdk_expects(hermes: ScriptedServer, client: openai.OpenAI) -> None:
    hermes.script("Hmm.</think>Hello there, streamed.")
    reply = hermes.server.post("/v1/responses", {"model": "tiny-llama", "input": "Hi", "stream": True})
    assert reply.status == 200 and reply.content_type.startswith("text/event-stream")
    events = sse_events(reply.text)
    assert all(name == data["type"] for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    kinds = [data["type"] for _, data in events]
    squeezed = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]  # runs of deltas as one
    item = ["response.output_item.added", "response.content_part.added"]
    assert squeezed == [
        "response.created",
        "response.in_progress",
        *item,
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        *item,
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds.count("response.output_text.delta") > 1
    final = events[-1][1]["response"]
    assert final["output"][1]["content"][0]["text"] == "Hello there, streamed."

    with client.responses.stream(model="tiny-llama", input="Hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        response = stream.get_final_response()
    assert "".join(deltas) == response.output_text == "Hello there, streamed."


def test_a_function_call_round_trip_with_previous_response_id(
    hermes: ScriptedServer, client: openai.OpenAI
) -> None:
    hermes.script("Tool time.</think>" + tool_call_text("get_weather", {"city": "Paris", "days": 2}))
    first = client.responses.create(model="tiny-llama", input="Weather in Paris?", tools=TOOLS)
    [call] = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris", "days": 2}
    assert call.call_id and call.id and call.id.startswith("fc_")
    assert first.tools[0].name == "get_weather"  # type: ignore[union-attr]

    hermes.script("All done.</think>It is sunny.")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}
    second = client.responses.create(
        model="tiny-llama", input=[output], tools=TOOLS, previous_response_id=first.id
    )
    assert second.output_text == "It is sunny." and second.previous_response_id == first.id
    prompt = hermes.last_prompt()  # the stored turn, then the tool's answer
    assert (
        prompt.index("Weather in Paris?")
        < prompt.index('<tool_call>\n{"name": "get_weather"')
        < prompt.index("sunny")
    )
    assert "<think>Tool time.</think>" in prompt

    # The same turn sent back by the client itself (store off): its output items, then the tool's output
    hermes.script("All done.</think>It is sunny.")
    items = [
        {"role": "user", "content": "Weather in Paris?"},
        *(i.model_dump() for i in first.output),
        output,
    ]
    third = client.responses.create(model="tiny-llama", input=items, tools=TOOLS, store=False)
    assert third.output_text == "It is sunny." and hermes.last_prompt() == prompt

    hermes.script("Tool time.</think>" + tool_call_text("get_weather", {"city": "Oslo"}))
    with client.responses.stream(model="tiny-llama", input="Weather in Oslo?", tools=TOOLS) as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert (
        "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    )
    [call] = [item for item in streamed.output if item.type == "function_call"]
    assert json.loads(call.arguments) == {"city": "Oslo"}


def test_an_unknown_or_unstored_previous_response_is_a_404(
    hermes: ScriptedServer, client: openai.OpenAI
) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model="tiny-llama", input="Hi", previous_response_id="resp_nope")
    assert missing.value.code == "previous_response_not_found"
    hermes.script("x</think>unstored")
    unstored = client.responses.create(model="tiny-llama", input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny-llama", input="Hi", previous_response_id=unstored.id)


class Weather(pydantic.BaseModel):
    city: str
    days: int


def test_text_format_json_schema_through_parse(hermes: ScriptedServer, client: openai.OpenAI) -> None:
    hermes.script('ok</think>{"city": "Paris", "days": 3}')
    response = client.responses.parse(model="tiny-llama", input="Weather?", text_format=Weather)
    assert response.output_parsed == Weather(city="Paris", days=3)
    structured = hermes.server.fake.submits()[-1].params.structured
    assert structured is not None and structured.kind == "json_schema"
    assert json.loads(structured.spec)["properties"]["city"] == {"title": "City", "type": "string"}
    assert structured.reasoning_end == "</think>"  # held only after the thinking


def test_max_output_tokens_makes_an_incomplete_response(server: ApiServer) -> None:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=30) as c:
        response = c.responses.create(model="tiny-llama", input="Count with me", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None and response.usage.output_tokens == 3
    assert server.fake.submits()[-1].params.max_tokens == 3


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 2**40}, "max_output_tokens"),
        ({"temperature": 7}, "temperature"),
        ({"top_p": -1}, "top_p"),
        ({"input": [{"type": "input_image", "image_url": "x"}]}, "input"),
        ({"input": [{"role": "narrator", "content": "x"}]}, "input"),
        ({"input": []}, "input"),
        ({"input": None}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "", "output": "x"}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"text": {"format": {"type": "yaml"}}}, "text"),
        ({"text": {"format": {"type": "json_schema", "schema": {}}}}, "text"),
        ({"reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"instructions": 5}, "instructions"),
        ({"previous_response_id": "x" * 500}, "previous_response_id"),
        ({"truncation": "auto"}, "truncation"),
        ({"background": True}, "background"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"store": "yes"}, "store"),
        ({"metadata": {"k": 5}}, "metadata"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_out_of_range_fields_are_400s_naming_them(
    server: ApiServer, fields: dict[str, Any], param: str
) -> None:
    before = len(server.fake.submits())
    error = assert_error(server.post("/v1/responses", {"model": "tiny-llama", "input": "Hi", **fields}), 400)
    assert error["param"] == param
    assert len(server.fake.submits()) == before


def test_every_field_is_in_the_endpoints_page() -> None:
    text = (REPO / "docs" / "api" / "responses.md").read_text()
    missing = sorted(name for name in RESPONSES_FIELDS if f"`{name}`" not in text)
    assert not missing


def test_a_stored_response_is_only_its_keys(make_server: Any, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice:sk-alice-0123456789\nbob:sk-bob-0123456789\n")
    server = make_server(ApiConfig(api_key_file=str(keys)))

    def client(key: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=30)

    with client("sk-alice-0123456789") as alice, client("sk-bob-0123456789") as bob:
        first = alice.responses.create(model="tiny-llama", input="Hi", max_output_tokens=2)
        with pytest.raises(openai.NotFoundError):
            bob.responses.create(model="tiny-llama", input="Hi", previous_response_id=first.id)
        alice.responses.create(
            model="tiny-llama", input="Hi", previous_response_id=first.id, max_output_tokens=2
        )


def test_sampling_fields_reach_the_scheduler(hermes: ScriptedServer, client: openai.OpenAI) -> None:
    hermes.script("x</think>ok")
    client.responses.create(model="tiny-llama", input="Hi", temperature=0.25, top_p=0.5, max_output_tokens=9)
    params = hermes.server.fake.submits()[-1].params
    assert (params.temperature, params.top_p, params.max_tokens) == (0.25, 0.5, 9)
    client.responses.create(model="tiny-llama", input="Hi", reasoning={"effort": "none"})
    assert hermes.last_prompt().endswith("<think>\n\n</think>")  # the template's enable_thinking false


def test_an_empty_answer_is_an_empty_message(hermes: ScriptedServer, client: openai.OpenAI) -> None:
    hermes.script("</think>")
    response = client.responses.create(model="tiny-llama", input="Hi")
    [message] = response.output
    assert message.type == "message" and response.output_text == "" and response.status == "completed"
    with client.responses.stream(model="tiny-llama", input="Hi") as stream:
        kinds = [e.type for e in stream]
        streamed = stream.get_final_response()
    assert [item.type for item in streamed.output] == ["message"] and "response.output_text.done" in kinds
