"""X-Request-Id: the client's id (or a made-up one) comes back on every response, streamed or not, errors
too, and names the response (`cmpl-<id>`, `chatcmpl-<id>`, as vLLM's); an id that cannot be echoed is a
400."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer, parse_sse

USER = [{"role": "user", "content": "hi"}]
COMPLETION = {"prompt": "Hello there", "max_tokens": 3}
CHAT = {"messages": USER, "max_tokens": 3}
HEX_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
def http(server: ApiServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


def test_a_given_id_names_the_response_and_comes_back(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "trace-42/a:b"})
    assert reply.status_code == 200 and reply.headers["x-request-id"] == "trace-42/a:b"
    assert reply.json()["id"] == "cmpl-trace-42/a:b"
    reply = http.post("/v1/chat/completions", json=CHAT, headers={"x-request-id": "chat 7"})
    assert reply.headers["x-request-id"] == "chat 7" and reply.json()["id"] == "chatcmpl-chat 7"


def test_without_one_a_fresh_id_names_the_response(http: httpx.Client) -> None:
    ids = set()
    for _ in range(3):
        reply = http.post("/v1/completions", json=COMPLETION)
        rid = reply.headers["x-request-id"]
        assert HEX_ID.fullmatch(rid) and reply.json()["id"] == "cmpl-" + rid
        ids.add(rid)
    assert len(ids) == 3
    empty = http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": ""})  # as if not given
    assert empty.status_code == 200 and HEX_ID.fullmatch(empty.headers["x-request-id"])


def test_streams_carry_it_in_their_headers_and_every_chunk(http: httpx.Client) -> None:
    for path, body, prefix in (
        ("/v1/completions", COMPLETION, "cmpl-"),
        ("/v1/chat/completions", CHAT, "chatcmpl-"),
    ):
        request = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with http.stream("POST", path, json=request, headers={"X-Request-Id": "s-1"}) as reply:
            assert reply.status_code == 200 and reply.headers["x-request-id"] == "s-1"
            chunks = parse_sse(reply.read().decode())
        assert len(chunks) > 2 and {c["id"] for c in chunks} == {prefix + "s-1"}


def test_error_responses_carry_it_too(http: httpx.Client) -> None:
    headers = {"X-Request-Id": "err-1"}
    for reply in (
        http.post("/v1/completions", json={"prompt": "a", "functions": [{}]}, headers=headers),
        http.post("/v1/completions", content=b"{not json", headers=headers),
        http.post("/v1/completions", json={"prompt": "a", "model": "nope"}, headers=headers),
        http.post("/v1/nowhere", json={}, headers=headers),
        http.get("/v1/completions", headers=headers),
        http.post("/tokenize", json={"tokens": 1}, headers=headers),
    ):
        assert reply.status_code >= 400 and reply.headers["x-request-id"] == "err-1"
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_other_endpoints_echo_it(http: httpx.Client) -> None:
    for method, path, body in (
        ("GET", "/health", None),
        ("GET", "/v1/models", None),
        ("GET", "/version", None),
        ("POST", "/tokenize", {"prompt": "a"}),
        ("POST", "/detokenize", {"tokens": [1]}),
    ):
        reply = http.request(method, path, json=body, headers={"X-Request-Id": "x" + path})
        assert reply.status_code == 200 and reply.headers["x-request-id"] == "x" + path


@pytest.mark.parametrize(
    "value",
    [b"x" * 257, "caf\u00e9".encode("latin-1"), b"a\tb"],
    ids=["too long", "not ascii", "a tab"],
)
def test_an_id_that_cannot_be_echoed_is_a_400_under_a_fresh_id(http: httpx.Client, value: bytes) -> None:
    reply = http.post("/v1/completions", json=COMPLETION, headers=[(b"X-Request-Id", value)])
    assert reply.status_code == 400 and "X-Request-Id" in reply.json()["error"]["message"]
    assert HEX_ID.fullmatch(reply.headers["x-request-id"])
    longest = http.post("/v1/completions", json=COMPLETION, headers={"X-Request-Id": "y" * 256})
    assert longest.status_code == 200 and longest.headers["x-request-id"] == "y" * 256


def test_two_ids_are_a_400(http: httpx.Client) -> None:
    reply = http.post(
        "/v1/completions", json=COMPLETION, headers=[(b"X-Request-Id", b"a"), (b"X-Request-Id", b"b")]
    )
    assert reply.status_code == 400 and HEX_ID.fullmatch(reply.headers["x-request-id"])


def test_refused_for_the_api_key_it_still_comes_back(tiny_model_dir: Any) -> None:
    api = ApiServer(str(tiny_model_dir), ApiConfig(api_key="sk-rid"))
    try:
        reply = httpx.post(
            api.base_url + "/v1/completions", json=COMPLETION, headers={"X-Request-Id": "no-key"}
        )
        assert reply.status_code == 401 and reply.headers["x-request-id"] == "no-key"
    finally:
        api.close()


def test_the_openai_client_sees_it(server: ApiServer) -> None:
    with openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30
    ) as client:
        completion = client.completions.create(
            model="tiny-llama", prompt="Hi", max_tokens=2, extra_headers={"X-Request-Id": "oa-1"}
        )
        assert completion._request_id == "oa-1" and completion.id == "cmpl-oa-1"
        stream = client.chat.completions.create(
            model="tiny-llama",
            messages=USER,
            max_tokens=2,
            stream=True,
            extra_headers={"X-Request-Id": "oa-2"},
        )
        assert {chunk.id for chunk in stream} == {"chatcmpl-oa-2"}
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(
                model="tiny-llama",
                prompt="Hi",
                max_tokens=2,
                extra_body={"priority": 1},
                extra_headers={"X-Request-Id": "oa-3"},
            )
        assert info.value.request_id == "oa-3"


def test_the_access_log_names_it(server: ApiServer, capsys: pytest.CaptureFixture[str]) -> None:
    server.post("/v1/completions", COMPLETION, headers={"X-Request-Id": "logged-1"})
    lines = [line for line in capsys.readouterr().out.splitlines() if "x_request_id" in line]
    assert any("logged-1" in line and "route=/v1/completions" in line for line in lines), lines
