"""The official `openai` Python client talks to the api, streaming and not."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.api.harness import ApiServer


@pytest.fixture
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def test_models_list(client: openai.OpenAI, server: ApiServer) -> None:
    [model] = client.models.list().data
    assert model.id == "tiny-llama" and model.owned_by == "pagedserve"
    assert model.model_extra is not None and model.model_extra["root"] == server.fake.model_root


def test_completion(client: openai.OpenAI) -> None:
    completion = client.completions.create(model="tiny-llama", prompt="Hello there", max_tokens=5, seed=1)
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5


def test_streamed_completion_matches(client: openai.OpenAI) -> None:
    request = {"model": "tiny-llama", "prompt": "Hello stream", "max_tokens": 6}
    full = client.completions.create(**request).choices[0].text
    stream = client.completions.create(**request, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_chat(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say something"}]
    response = client.chat.completions.create(
        model="tiny-llama", messages=messages, max_completion_tokens=4, logprobs=True, top_logprobs=2
    )
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == 4 and len(choice.logprobs.content[0].top_logprobs) == 2

    stream = client.chat.completions.create(model="tiny-llama", messages=messages, max_tokens=4, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content


def test_errors_become_typed_exceptions(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model="tiny-llama", prompt="x", max_tokens=10**9)
    assert bad.value.code == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-llama", messages=[], max_tokens=2)
