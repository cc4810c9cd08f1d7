"""A tool-call round trip through `scripts/start`'s stack (honcho on the Procfile) on the tiny random model,
driven by the openai client: a forced call (tool_choice required, then a named function), the tool's
result, the final answer. A random model writes valid calls only because structured output holds it to the
schema (worker/structured.py). The stack has no tool flags: the api finds hermes from the chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from scripts._servers import Honcho
from tests.api.chat_templates import HERMES, checkpoint_with_template

pytestmark = pytest.mark.e2e

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Any, tmp_path_factory: Any) -> Iterator[Honcho]:
    root = checkpoint_with_template(tiny_model_dir, tmp_path_factory.mktemp("tools") / "ckpt", HERMES)
    logs = tmp_path_factory.mktemp("logs") / "honcho.log"
    stack = Honcho(
        root,
        logs,
        num_kv_blocks=256,
        max_model_len=1024,
        reasoning_parser="qwen3",
        trust_request_chat_template="true",
    )
    try:
        stack.wait_healthy()
        yield stack
    finally:
        stack.stop()


def check_calls(calls: Any) -> None:
    assert calls
    for call in calls:
        schema = next(
            t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name
        )
        jsonschema.validate(json.loads(call.function.arguments), schema)


def test_tool_call_round_trip(stack: Honcho) -> None:
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=300)
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Oslo?"}]
    # Thinking off: with it on, a forced call comes after </think> (vLLM's rule), which a random model
    # would take thousands of tokens to write (tests/api/test_chat_templates.py checks that grammar).
    no_thinking = {"chat_template_kwargs": {"enable_thinking": False}}
    request = dict(
        model=client.models.list().data[0].id, tools=TOOLS, max_tokens=200, temperature=1.0, seed=3,
        extra_body=no_thinking,
    )  # fmt: skip
    first = client.chat.completions.create(
        messages=messages, tool_choice="required", parallel_tool_calls=False, **request
    )
    check_calls(first.choices[0].message.tool_calls)
    assert first.choices[0].finish_reason == "tool_calls"

    named = {"type": "function", "function": {"name": "get_weather"}}
    with client.chat.completions.stream(messages=messages, tool_choice=named, **request) as stream:
        second = stream.get_final_completion()
    [call] = second.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    check_calls([call])

    messages.append(second.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 4}'})
    # thinking off: the template closes its <think> block, so a random model's answer is content
    final = client.chat.completions.create(messages=messages, tool_choice="none", **request)
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls


def test_auto_with_no_flags_uses_the_templates_parser(stack: Honcho) -> None:
    """tool_choice auto (tools and no tool_choice) is served with no tool flags: the api logged the parser it
    found in the chat template, and a random model's text comes back as content."""
    client = openai.OpenAI(base_url=stack.url + "/v1", api_key="x", max_retries=0, timeout=300)
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=TOOLS,
        max_tokens=8,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
    lines = stack.log_path.read_text(errors="replace").splitlines()
    detected = [line for line in lines if "tool_call_parser_detected" in line]
    assert detected and all("hermes" in line for line in detected), detected


def test_request_template_renders_in_the_sandboxed_child(stack: Honcho, tiny_model_dir: Any) -> None:
    """Under the real api process (started by the supervisor), a request's own template is rendered by the
    spawned child, and a runaway one is a 400 that leaves the api serving."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{{ suffix }}"
    body = {
        "messages": [{"role": "user", "content": "Hello"}],
        "chat_template": template,
        "chat_template_kwargs": {"suffix": "Answer:"},
        "max_tokens": 1,
    }
    status, reply = stack.post(body, "/v1/chat/completions")
    assert status == 200, reply
    expected = tokenizer("user: Hello\nAnswer:", add_special_tokens=False)["input_ids"]
    assert reply["usage"]["prompt_tokens"] == len(expected)
    runaway = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
    status, reply = stack.post({**body, "chat_template": runaway}, "/v1/chat/completions")
    assert status == 400 and "longer than" in reply["error"]["message"]
    assert stack.post(body, "/v1/chat/completions")[0] == 200
