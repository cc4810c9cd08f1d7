"""Structured output end to end through the real processes (scripts/start's scheduler, worker and api), driven
by the official `openai` client: `chat.completions.parse` with a pydantic model, vLLM's `structured_outputs`
through `extra_body` with n > 1 and streaming, and a 400 for a schema xgrammar refuses. The model is the tiny
random one sampling at temperature 1: whatever it draws, the output must parse."""

from __future__ import annotations

import asyncio
import json
import re
from typing import Literal

import jsonschema
import pytest
from openai import AsyncOpenAI, BadRequestError
from pydantic import BaseModel, Field

pytestmark = pytest.mark.e2e


class Reading(BaseModel):
    sensor: Literal["north", "south", "east"]
    value: int = Field(ge=-40, le=125)
    ok: bool
    code: str = Field(pattern=r"^[A-Z]{2}[0-9]$")


def _client(server) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


async def _model(client: AsyncOpenAI) -> str:
    return (await client.models.list()).data[0].id


def test_chat_completions_parse_with_a_pydantic_model(server):
    async def run():
        client = _client(server)
        model = await _model(client)
        parsed = []
        for seed in range(2):
            r = await client.chat.completions.parse(
                model=model,
                messages=[{"role": "user", "content": "Report one sensor reading."}],
                response_format=Reading,
                temperature=1.0,
                seed=seed,
                max_completion_tokens=400,
            )
            choice = r.choices[0]
            assert choice.finish_reason == "stop", choice.message.content
            assert isinstance(choice.message.parsed, Reading)
            parsed.append(choice.message.parsed)
        return parsed

    readings = asyncio.run(run())
    assert len(readings) == 2


def test_json_schema_outputs_end_and_validate_at_temperature_1(server):
    """Issue 39's report: response_format json_schema, a small schema, temperature 1, the random model. With
    free whitespace 4 of 5 outputs were `{` and whitespace until max_tokens; compact, every one ends."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "item", "schema": schema}}

    async def run():
        client = _client(server)
        model = await _model(client)
        return await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "An item."}], response_format=response_format,
            temperature=1.0, n=5, max_tokens=200, seed=0,
        )  # fmt: skip

    reply = asyncio.run(run())
    for choice in reply.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_structured_outputs_with_n_and_streaming(server):
    schema = {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]}},
        "required": ["id", "tag"],
        "additionalProperties": False,
    }
    constraint = {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}

    async def run():
        client = _client(server)
        model = await _model(client)
        r = await client.completions.create(
            model=model, prompt="JSON:", n=3, max_tokens=100, temperature=1.0, extra_body=constraint
        )
        texts = [c.text for c in r.choices]
        assert all(c.finish_reason == "stop" for c in r.choices)
        chunks = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "a tag"}],
            max_tokens=100,
            temperature=1.0,
            stream=True,
            extra_body={"guided_regex": r"[a-c]{2}-[0-9]{1,2}"},
        )
        streamed = ""
        async for chunk in chunks:
            streamed += chunk.choices[0].delta.content or ""
        return texts, streamed

    texts, streamed = asyncio.run(run())
    for text in texts:
        jsonschema.validate(json.loads(text), schema)
    assert re.fullmatch(r"[a-c]{2}-[0-9]{1,2}", streamed)


def test_an_invalid_schema_is_a_400_and_the_server_goes_on(server):
    async def run():
        client = _client(server)
        model = await _model(client)
        with pytest.raises(BadRequestError) as e:
            await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": "hi"}],
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                },
            )
        assert e.value.body["param"] == "response_format"
        r = await client.completions.create(
            model=model, prompt="x", max_tokens=20, extra_body={"guided_choice": ["left", "right"]}
        )
        return r.choices[0].text

    assert asyncio.run(run()) in ("left", "right")
