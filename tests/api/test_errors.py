"""Bad requests get a 400 with OpenAI's error body, and the server keeps serving; readiness and refusals."""

from __future__ import annotations

from typing import Any

import pytest

from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer, HttpReply

USER = [{"role": "user", "content": "hi"}]

BAD_COMPLETIONS: list[tuple[str, Any]] = [
    ("malformed json", b'{"prompt": "abc", '),
    ("body not an object", ["abc"]),
    ("no prompt", {"max_tokens": 4}),
    ("empty prompt", {"prompt": ""}),
    ("empty token list", {"prompt": []}),
    ("empty prompt in a batch", {"prompt": ["abc", []]}),
    ("prompt of the wrong type", {"prompt": 42}),
    ("token id outside the vocabulary", {"prompt": [1, 2, 4096]}),
    ("negative token id", {"prompt": [1, -2]}),
    ("bool where int", {"prompt": "abc", "max_tokens": True}),
    ("string where int", {"prompt": "abc", "max_tokens": "16"}),
    ("float where int", {"prompt": "abc", "max_tokens": 16.5}),
    ("string where number", {"prompt": "abc", "temperature": "hot"}),
    ("negative max_tokens", {"prompt": "abc", "max_tokens": -1}),
    ("zero max_tokens", {"prompt": "abc", "max_tokens": 0}),
    ("huge max_tokens", {"prompt": "abc", "max_tokens": 10**12}),
    ("max_tokens past the context", {"prompt": "abc", "max_tokens": 255}),
    ("prompt over max_model_len", {"prompt": list(range(1, 300))}),
    ("n = 0", {"prompt": "abc", "n": 0}),
    ("n too large", {"prompt": "abc", "n": 1000}),
    ("negative temperature", {"prompt": "abc", "temperature": -1}),
    ("top_p of zero", {"prompt": "abc", "top_p": 0}),
    ("seed of the wrong type", {"prompt": "abc", "seed": "x"}),
    ("presence_penalty past 2", {"prompt": "abc", "presence_penalty": 2.5}),
    ("frequency_penalty below -2", {"prompt": "abc", "frequency_penalty": -3}),
    ("best_of other than n", {"prompt": "abc", "best_of": 3}),
    ("echo not a boolean", {"prompt": "abc", "echo": "yes"}),
    ("logprobs too large", {"prompt": "abc", "logprobs": 50}),
    ("logprobs as a bool", {"prompt": "abc", "logprobs": True}),
    ("logit_bias past 100", {"prompt": "abc", "logit_bias": {"5": 101}}),
    ("suffix", {"prompt": "abc", "suffix": "xyz"}),
    ("functions, the deprecated tools", {"prompt": "abc", "functions": [{"name": "f"}]}),
    ("empty stop string", {"prompt": "abc", "stop": ""}),
    ("stop of the wrong type", {"prompt": "abc", "stop": [1]}),
    ("stop token id outside the vocabulary", {"prompt": "abc", "stop_token_ids": [99999]}),
    ("unknown stream option", {"prompt": "abc", "stream": True, "stream_options": {"continuous": True}}),
    ("stream of the wrong type", {"prompt": "abc", "stream": "yes"}),
    ("priority as a string", {"prompt": "abc", "priority": "high"}),
    ("priority as a float", {"prompt": "abc", "priority": 1.5}),
    ("priority as a bool", {"prompt": "abc", "priority": True}),
    ("huge priority", {"prompt": "abc", "priority": 2**40}),
    ("empty cache_salt", {"prompt": "abc", "cache_salt": ""}),
    ("cache_salt of the wrong type", {"prompt": "abc", "cache_salt": 7}),
]

BAD_CHATS: list[tuple[str, Any]] = [
    ("no messages", {"max_tokens": 2}),
    ("empty messages", {"messages": []}),
    ("unknown role", {"messages": [{"role": "robot", "content": "hi"}]}),
    ("content not text", {"messages": [{"role": "user", "content": 5}]}),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
    ("top_logprobs without logprobs", {"messages": USER, "top_logprobs": 2}),
    ("tools", {"messages": USER, "tools": [{"type": "function", "function": {"name": "f"}}]}),
    ("structural_tag response_format", {"messages": USER, "response_format": {"type": "structural_tag"}}),
    ("max_completion_tokens as a string", {"messages": USER, "max_completion_tokens": "5"}),
    ("priority as a string", {"messages": USER, "priority": "1"}),
    ("cache_salt as a list", {"messages": USER, "cache_salt": ["a"]}),
    ("empty cache_salt", {"messages": USER, "cache_salt": ""}),
]


def assert_error(reply: HttpReply, status: int, error_type: str = "invalid_request_error") -> dict[str, Any]:
    assert reply.status == status, reply.text
    assert reply.content_type.startswith("application/json")
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["type"] == error_type
    return error


def assert_still_serving(server: ApiServer) -> None:
    reply = server.post("/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 2


def send(server: ApiServer, path: str, body: Any) -> HttpReply:
    if isinstance(body, bytes):
        return server.request("POST", path, raw=body)
    return server.post(path, body)


@pytest.mark.parametrize("body", [b for _, b in BAD_COMPLETIONS], ids=[name for name, _ in BAD_COMPLETIONS])
def test_bad_completion_requests_get_400(server: ApiServer, body: Any) -> None:
    assert_error(send(server, "/v1/completions", body), 400)
    assert_still_serving(server)


@pytest.mark.parametrize("body", [b for _, b in BAD_CHATS], ids=[name for name, _ in BAD_CHATS])
def test_bad_chat_requests_get_400(server: ApiServer, body: Any) -> None:
    assert_error(send(server, "/v1/chat/completions", body), 400)
    assert_still_serving(server)


def test_errors_name_the_parameter(server: ApiServer) -> None:
    error = assert_error(server.post("/v1/completions", {"prompt": "abc", "max_tokens": 10**12}), 400)
    assert error["param"] == "max_tokens" and error["code"] == "context_length_exceeded"
    error = assert_error(server.post("/v1/completions", {"prompt": "abc", "temperature": "x"}), 400)
    assert error["param"] == "temperature"


def test_fields_that_change_nothing_are_accepted(server: ApiServer) -> None:
    request = {"prompt": "abc", "max_tokens": 2, "user": "u1", "metadata": {"k": "v"}, "store": False}
    neutral = {"presence_penalty": 0, "frequency_penalty": 0.0, "best_of": 1, "echo": False, "logit_bias": {}}
    assert server.post("/v1/completions", {**request, **neutral}).status == 200
    chat = {
        "messages": USER,
        "max_tokens": 2,
        "user": "u1",
        "tool_choice": "none",
        "parallel_tool_calls": False,
    }
    assert server.post("/v1/chat/completions", chat).status == 200


def test_unknown_model_is_404(server: ApiServer) -> None:
    error = assert_error(server.post("/v1/completions", {"model": "gpt-4", "prompt": "abc"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert server.get("/v1/models/gpt-4").status == 404
    assert_still_serving(server)


def test_unknown_route_is_404_with_an_error_body(server: ApiServer) -> None:
    assert_error(server.post("/v1/edits", {}), 404)


def test_scheduler_refusal_is_a_400(make_server: Any) -> None:
    server = make_server(num_kv_blocks=1)  # two blocks' worth of tokens cannot fit
    error = assert_error(server.post("/v1/completions", {"prompt": [1] * 10, "max_tokens": 20}), 400)
    assert "KV cache" in error["message"]
    events = server.post("/v1/completions", {"prompt": [1] * 10, "max_tokens": 20, "stream": True})
    assert_error(events, 400)  # refused before the stream started, so still a status
    assert server.post("/v1/completions", {"prompt": [1] * 4, "max_tokens": 4}).status == 200


def test_oversized_body_is_refused(make_server: Any) -> None:
    server = make_server(config=ApiConfig(max_request_bytes=1000))
    assert_error(server.post("/v1/completions", {"prompt": "x" * 2000}), 413)
    assert_still_serving(server)


def test_not_ready_scheduler_means_503_then_service(make_server: Any) -> None:
    server = make_server(ready=False)
    assert server.get("/health").status == 503
    assert_error(server.post("/v1/completions", {"prompt": "abc"}), 503, "service_unavailable")
    assert_error(server.post("/v1/chat/completions", {"messages": USER}), 503, "service_unavailable")
    assert server.get("/v1/models").status == 503
    server.fake.ready = True
    assert server.get("/health").status == 200
    assert_still_serving(server)


def test_health_is_503_when_the_scheduler_does_not_answer(make_server: Any) -> None:
    server = make_server()
    assert server.get("/health").status == 200
    server.fake.answer_info = False
    reply = server.get("/health")
    assert reply.status == 503 and "does not answer" in reply.json()["reason"]
    assert server.get("/metrics").status == 503
