"""`priority` and `cache_salt` reach the scheduler from both endpoints, and cached prompt tokens come back
in the usage; the fake scheduler caches a repeated prompt's whole blocks per cache_salt."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.harness import ApiServer

USER = [{"role": "user", "content": "tell me about the block manager"}]


def cached_tokens(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def prioritized(tiny_model_dir: Any) -> Any:
    """A server whose scheduler runs the priority policy: under fcfs a non-zero priority is a 400."""
    api = ApiServer(str(tiny_model_dir), scheduling_policy="priority")
    yield api
    api.close()


def test_completion_passes_priority_and_cache_salt_for_every_prompt(prioritized: ApiServer) -> None:
    server = prioritized
    request = {
        "prompt": ["first prompt", [7, 8, 9]],
        "max_tokens": 2,
        "priority": -3,
        "cache_salt": "tenant-a",
    }
    assert server.post("/v1/completions", request).status == 200
    submits = server.fake.submits()[-2:]
    assert [(s.priority, s.cache_salt) for s in submits] == [(-3, "tenant-a")] * 2


def test_chat_passes_priority_and_cache_salt(prioritized: ApiServer) -> None:
    server = prioritized
    request = {"messages": USER, "max_tokens": 2, "priority": 5, "cache_salt": "tenant-b", "stream": True}
    server.stream("/v1/chat/completions", request)
    last = server.fake.submits()[-1]
    assert (last.priority, last.cache_salt) == (5, "tenant-b")


def test_omitted_options_default_to_priority_zero_and_no_salt(server: ApiServer) -> None:
    assert server.post("/v1/completions", {"prompt": "abc", "max_tokens": 1}).status == 200
    assert server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 1}).status == 200
    assert [(s.priority, s.cache_salt) for s in server.fake.submits()[-2:]] == [(0, "")] * 2


def test_cached_tokens_are_reported_per_salt(server: ApiServer) -> None:
    prompt = list(range(600, 650))  # 50 tokens: three whole blocks can be cached
    request = {"prompt": prompt, "max_tokens": 2, "cache_salt": "salt-1"}
    assert cached_tokens(server.post("/v1/completions", request).json()) == 0
    assert cached_tokens(server.post("/v1/completions", request).json()) == 48
    other_salt = server.post("/v1/completions", {**request, "cache_salt": "salt-2"}).json()
    assert cached_tokens(other_salt) == 0


def test_chat_usage_reports_cached_tokens_also_when_streamed(server: ApiServer) -> None:
    messages = [{"role": "user", "content": "a chat prompt that only this test sends " * 4}]
    request = {"messages": messages, "max_tokens": 2, "cache_salt": "chat"}
    first = server.post("/v1/chat/completions", request).json()
    assert cached_tokens(first) == 0
    prompt_tokens = first["usage"]["prompt_tokens"]
    events = server.stream("/v1/chat/completions", {**request, "stream_options": {"include_usage": True}})
    assert cached_tokens(events[-1]) == (prompt_tokens - 1) // 16 * 16 > 0


def test_beam_search_fields_reach_the_scheduler(server: ApiServer) -> None:
    request = {"prompt": "abc", "max_tokens": 3, "n": 2, "best_of": 4, "use_beam_search": True}
    response = server.post("/v1/completions", {**request, "length_penalty": 0.5})
    assert response.status == 200 and len(response.json()["choices"]) == 2
    params = server.fake.submits()[-1].params
    assert (params.beam_width, params.n, params.length_penalty, params.temperature) == (4, 2, 0.5, 0.0)
    server.post("/v1/completions", {"prompt": "abc", "max_tokens": 3, "n": 3, "use_beam_search": True})
    assert server.fake.submits()[-1].params.beam_width == 3  # best_of defaults to n


def test_beam_search_refusals(server: ApiServer) -> None:
    base = {"prompt": "abc", "max_tokens": 3, "use_beam_search": True}
    for body, needle in (
        ({**base, "stream": True}, "stream"),
        ({**base, "n": 3, "best_of": 2}, "beam width"),
        ({**base, "temperature": 0.7}, "temperature"),
        ({**base, "logprobs": 2}, "logprobs"),
        ({"prompt": "abc", "length_penalty": 0.5}, "length_penalty"),
    ):
        response = server.post("/v1/completions", body)
        assert response.status == 400 and needle in response.json()["error"]["message"], body
