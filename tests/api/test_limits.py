"""Every field has a finite range, every string encodes, and one request's cost is bounded: all 400s with
OpenAI's error body, before anything reaches the scheduler, and the server keeps serving (issue 20)."""

from __future__ import annotations

from typing import Any

import pytest

from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer
from tests.api.test_errors import assert_error, assert_still_serving, send

USER = [{"role": "user", "content": "hi"}]
BEAM = {"prompt": "hi", "max_tokens": 4, "use_beam_search": True, "best_of": 2, "n": 2}

BAD_COMPLETIONS: list[tuple[str, Any]] = [
    ("length_penalty 1e308 (killed the scheduler)", {**BEAM, "length_penalty": 1e308}),
    ("length_penalty -1e308", {**BEAM, "length_penalty": -1e308}),
    ("length_penalty past 100", {**BEAM, "length_penalty": 100.5}),
    ("length_penalty as a huge int", {**BEAM, "length_penalty": 10**400}),
    ("NaN literal", b'{"prompt": "hi", "temperature": NaN}'),
    ("Infinity literal", b'{"prompt": "hi", "top_p": Infinity}'),
    ("-Infinity literal", b'{"prompt": "hi", "temperature": -Infinity}'),
    ("a number that overflows to inf", b'{"prompt": "hi", "temperature": 1e400}'),
    ("NaN inside an ignored field", b'{"prompt": "hi", "metadata": {"x": NaN}}'),
    ("an integer of 5000 digits", b'{"prompt": "hi", "seed": ' + b"9" * 5000 + b"}"),
    ("temperature past 100", {"prompt": "hi", "temperature": 1e308}),
    ("top_p past 1", {"prompt": "hi", "top_p": 1.5}),
    ("top_k past int32", {"prompt": "hi", "top_k": 2**40}),
    ("seed past 64 bits", {"prompt": "hi", "seed": 2**64}),
    ("lone surrogate in the prompt", {"prompt": "a\ud800b"}),
    ("lone surrogate in a batch", {"prompt": ["ok", "\udfff"]}),
    ("lone surrogate in stop", {"prompt": "hi", "stop": ["\ud800"]}),
    ("lone surrogate in cache_salt", {"prompt": "hi", "cache_salt": "\ud800"}),
    ("lone surrogate in a key", {"prompt": "hi", "\ud800": 1}),
    ("raw surrogate bytes", b'{"prompt": "\xed\xa0\x80"}'),
    ("nested 100,000 deep", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("nested 100,000 deep, objects", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    ("17 stop strings", {"prompt": "hi", "stop": ["s"] * 17}),
    ("a stop string of 1025 characters", {"prompt": "hi", "stop": "s" * 1025}),
    ("1025 stop token ids", {"prompt": "hi", "stop_token_ids": [1] * 1025}),
    ("cache_salt of 1025 characters", {"prompt": "hi", "cache_salt": "s" * 1025}),
    ("priority past int32", {"prompt": "hi", "priority": -(2**31)}),
    ("best_of past the beam limit", {**BEAM, "best_of": 10**6}),
    ("max_tokens past 2**63", {"prompt": "hi", "max_tokens": 2**64}),
    ("too many sequences: prompts x n", {"prompt": ["a"] * 3, "n": 100}),
    ("too many prompts", {"prompt": ["a"] * 257}),
    ("a prompt longer than any that fits", {"prompt": "x" * 300_000}),
    ("a long prompt in a batch", {"prompt": ["ok", "x" * 300_000]}),
]

BAD_CHATS: list[tuple[str, Any]] = [
    ("lone surrogate in content", {"messages": [{"role": "user", "content": "\ud800"}]}),
    (
        "lone surrogate in a text part",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
    ),
    ("lone surrogate in a name", {"messages": [{"role": "user", "content": "hi", "name": "\ud800"}]}),
    ("name not a string", {"messages": [{"role": "user", "content": "hi", "name": 5}]}),
    ("role a list (found by the fuzzer: unhashable)", {"messages": [{"role": ["user"], "content": "hi"}]}),
    ("name a list", {"messages": [{"role": "user", "content": "hi", "name": ["a"]}]}),
    ("name too long", {"messages": [{"role": "user", "content": "hi", "name": "n" * 257}]}),
    ("too many messages", {"messages": USER * 4097}),
    ("a conversation longer than any that fits", {"messages": [{"role": "user", "content": "x" * 300_000}]}),
    ("NaN temperature", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'),
    ("nested 100,000 deep", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
]


@pytest.mark.parametrize("body", [b for _, b in BAD_COMPLETIONS], ids=[name for name, _ in BAD_COMPLETIONS])
def test_out_of_range_completion_requests_get_400(server: ApiServer, body: Any) -> None:
    submitted = len(server.fake.submits())
    assert_error(send(server, "/v1/completions", body), 400)
    assert len(server.fake.submits()) == submitted  # refused at the api, never sent on
    assert_still_serving(server)


@pytest.mark.parametrize("body", [b for _, b in BAD_CHATS], ids=[name for name, _ in BAD_CHATS])
def test_out_of_range_chat_requests_get_400(server: ApiServer, body: Any) -> None:
    assert_error(send(server, "/v1/chat/completions", body), 400)
    assert_still_serving(server)


def test_the_range_errors_name_their_parameter(server: ApiServer) -> None:
    error = assert_error(server.post("/v1/completions", {**BEAM, "length_penalty": 1e308}), 400)
    assert error["param"] == "length_penalty"
    error = assert_error(server.post("/v1/completions", {"prompt": ["a"] * 3, "n": 100}), 400)
    assert error["param"] == "n" and "300 sequences" in error["message"]


def test_a_prompt_that_cannot_fit_is_refused_before_tokenizing(server: ApiServer) -> None:
    error = assert_error(server.post("/v1/completions", {"prompt": "x" * 300_000}), 400)
    # The message gives the length in characters: no token count was computed.
    assert error["code"] == "context_length_exceeded" and "characters" in error["message"]
    chat = {"messages": [{"role": "user", "content": "x" * 300_000}]}
    error = assert_error(server.post("/v1/chat/completions", chat), 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"


def test_finite_values_inside_the_ranges_are_served(server: ApiServer) -> None:
    reply = server.post("/v1/completions", {**BEAM, "length_penalty": -100.0, "max_tokens": 2})
    assert reply.status == 200, reply.text
    body = {"prompt": "hi", "max_tokens": 2, "stop": ["s" * 1024] * 16, "cache_salt": "s" * 1024}
    assert server.post("/v1/completions", body).status == 200
    named = {"messages": [{"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 2}
    assert server.post("/v1/chat/completions", named).status == 200
    assert server.post("/v1/completions", {"prompt": ["a"] * 2, "n": 128, "max_tokens": 1}).status == 200


def test_the_sequence_cap_is_a_setting_and_counts_beams(make_server: Any) -> None:
    server: ApiServer = make_server(config=ApiConfig(max_seqs_per_request=4))
    assert server.post("/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1}).status == 200
    assert_error(server.post("/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}), 400)
    beams = {**BEAM, "prompt": ["a", "b"], "n": 1, "best_of": 3}  # 2 prompts x 3 beams
    assert_error(server.post("/v1/completions", beams), 400)
    assert_error(server.post("/v1/chat/completions", {"messages": USER, "n": 5}), 400)
    assert len(server.fake.submits()) == 2  # the first request's two prompts
