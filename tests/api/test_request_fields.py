"""Fields the api does not know are ignored as vLLM ignores them, with a log line and an X-Ignored-Fields
header (a 400 under --strict-request-fields); fields we know and would do wrongly are refused in any mode."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer
from tests.api.test_errors import assert_error

USER = [{"role": "user", "content": "hi"}]
SDK_EXTRAS = {
    "reasoning_effort": "low",
    "verbosity": "low",
    "prediction": {"type": "content", "content": "x"},
}
GENERATION = [
    ("/v1/completions", {"prompt": "abc", "max_tokens": 3}),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3}),
]
HEADER = "X-Ignored-Fields"


@pytest.fixture
def client(server: ApiServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.mark.parametrize(("path", "body"), GENERATION)
def test_unknown_fields_are_ignored_and_named_in_a_header(server: ApiServer, path: str, body: Any) -> None:
    plain = server.post(path, body)
    assert plain.status == 200 and plain.headers is not None and plain.headers.get(HEADER) is None
    submitted = server.fake.submits()[-1]
    dressed = server.post(path, {**body, **SDK_EXTRAS})
    assert dressed.status == 200, dressed.text
    assert (
        dressed.headers is not None and dressed.headers[HEADER] == "prediction, reasoning_effort, verbosity"
    )
    again = server.fake.submits()[-1]  # the same request reached the scheduler
    assert (again.prompt_token_ids, again.params) == (submitted.prompt_token_ids, submitted.params)
    assert dressed.json()["choices"] == plain.json()["choices"]


def test_the_log_says_so_once_per_request(server: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "frobnicate": 1}).status == 200
    lines = [line for line in capsys.readouterr().out.splitlines() if "request_fields_ignored" in line]
    assert len(lines) == 1 and "fields=frobnicate" in lines[0] and "path=/v1/completions" in lines[0]


def test_a_stream_carries_the_header(server: ApiServer) -> None:
    reply = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stream": True, "x_a": 1})
    assert reply.status == 200 and reply.content_type.startswith("text/event-stream")
    assert reply.headers is not None and reply.headers[HEADER] == "x_a"


def test_the_openai_client_sends_sdk_fields_and_reads_the_header(client: openai.OpenAI) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="tiny-llama",
        messages=USER,  # type: ignore[arg-type]
        max_tokens=2,
        reasoning_effort="low",
        extra_body={"modalities": ["text"], "chat_template_kwargs": {}, "frobnicate": {"deep": [1]}},
    )
    assert raw.headers[HEADER] == "frobnicate, reasoning_effort"
    assert raw.parse().choices[0].finish_reason == "length"
    raw = client.completions.with_raw_response.create(
        model="tiny-llama", prompt="abc", max_tokens=2, extra_body={"top_a": 0, "add_special_tokens": True}
    )
    assert raw.headers[HEADER] == "top_a" and raw.parse().usage.completion_tokens == 2


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"prompt": "abc", "truncation": True}),
        ("/tokenize", {"messages": USER, "truncation": True}),
        ("/detokenize", {"tokens": [5, 6], "truncation": True}),
    ],
)
def test_tokenization_ignores_them_too(server: ApiServer, path: str, body: Any) -> None:
    reply = server.post(path, body)
    assert reply.status == 200, reply.text
    assert reply.headers is not None and reply.headers[HEADER] == "truncation"
    plain = server.post(path, {k: v for k, v in body.items() if k != "truncation"})
    assert reply.json() == plain.json()


def test_strict_mode_refuses_them(make_server: Any) -> None:
    api = make_server(ApiConfig(strict_request_fields=True))
    for path, body in [*GENERATION, ("/tokenize", {"prompt": "abc"}), ("/detokenize", {"tokens": [5]})]:
        error = assert_error(api.post(path, {**body, "reasoning_effort": "low"}), 400)
        assert error["message"] == "unsupported parameter(s): reasoning_effort"
        assert error["param"] == "reasoning_effort"
    assert api.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, "user": "u"}).status == 200


REFUSED = [
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {"type": "object"}}], "'tools'"),
    ("/v1/chat/completions", "function_call", "auto", "'tool_choice'"),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "wav"}, "text"),
    ("/v1/chat/completions", "modalities", ["text", "audio"], "only ['text']"),
    ("/v1/chat/completions", "web_search_options", {}, "does not search the web"),
    ("/v1/completions", "truncate_prompt_tokens", 4, "shorten the prompt"),
    ("/v1/completions", "logits_processors", ["my.Processor"], "not supported"),
    ("/v1/completions", "add_special_tokens", False, "only True"),
    ("/v1/chat/completions", "add_special_tokens", True, "only False"),
    ("/v1/chat/completions", "echo", True, "not supported on chat"),
    ("/tokenize", "add_generation_prompt", True, "'messages'"),
    ("/detokenize", "skip_special_tokens", True, "keeps special tokens"),
]


@pytest.mark.parametrize(("path", "name", "value", "says"), REFUSED, ids=[r[1] for r in REFUSED])
def test_fields_we_would_do_wrongly_are_refused(
    server: ApiServer, path: str, name: str, value: Any, says: str
) -> None:
    body = {
        "/v1/chat/completions": {"messages": USER, "max_tokens": 2},
        "/v1/completions": {"prompt": "abc", "max_tokens": 2},
        "/tokenize": {"prompt": "abc"},
        "/detokenize": {"tokens": [5]},
    }[path]
    before = len(server.fake.submits())
    error = assert_error(server.post(path, {**body, name: value}), 400)
    assert error["param"] == name and says in error["message"], error
    assert len(server.fake.submits()) == before


def test_the_openai_clients_deprecated_functions_are_refused_clearly(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny-llama",
            messages=USER,  # type: ignore[arg-type]
            functions=[{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}],
        )
    assert "'tools'" in info.value.message


def test_a_null_refused_field_asks_for_nothing(server: ApiServer) -> None:
    reply = server.post("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "functions": None})
    assert reply.status == 200 and reply.headers is not None and reply.headers[HEADER] == "functions"
    text = {"messages": USER, "max_tokens": 2, "modalities": ["text"]}
    reply = server.post("/v1/chat/completions", text)
    assert reply.status == 200 and reply.headers is not None and reply.headers.get(HEADER) is None


def test_the_listing_is_bounded_and_printable(server: ApiServer) -> None:
    from pagedserve.api.request_fields import MAX_LISTED_FIELDS, listed

    hostile = {f"f{i:03}" + "x" * 300: i for i in range(200)} | {"a\r\nSet-Cookie: x": 1, "é,ü": 2}
    reply = server.post("/v1/completions", {"prompt": "abc", "max_tokens": 2, **hostile})
    assert reply.status == 200 and reply.headers is not None
    value = reply.headers[HEADER]
    assert value.isascii() and value.isprintable() and len(value) < 1600
    names = value.split(", ")
    assert names[0] == "a\\r\\nSet-Cookie: x" and names[1].startswith("f000xxx") and names[1].endswith("...")
    assert names[-1] == f"... ({len(hostile)} in all)" and len(names) == MAX_LISTED_FIELDS + 1
    assert reply.headers.get("Set-Cookie") is None
    assert listed(["é,ü"]) == json.dumps("é")[1:-1] + "\\u002c" + json.dumps("ü")[1:-1]
