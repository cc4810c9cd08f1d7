"""Property-based fuzzing of the two generation endpoints, against the api app in front of a fake scheduler.

Every answer must be a 2xx, or a 4xx with OpenAI's error body ({"error": {"message", "type", "param",
"code"}}); never a 5xx, never a dead process, and the app serves a plain request afterwards. A stream must
end with [DONE] and carry no internal error. Each test names the defect it guards (issue 20).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.api.protocol import CHAT_FIELDS, COMPLETION_FIELDS
from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer, HttpReply

FUZZ = settings(max_examples=400, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
ROUTES = ["/v1/completions", "/v1/chat/completions"]
EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63, 2**64, -(2**64), 10**30, 10**400]
EDGE_FLOATS = [1e308, -1e308, 5e-324, -0.0, 0.5, 1.0, 100.0, 100.0001, float("nan"), float("inf")]

surrogate_text = st.text(st.characters(codec=None, categories=["Cs", "Ll", "Nd", "Zs"]), max_size=12)
# Mostly ordinary text, so that bodies often get past the parser; now and then a lone surrogate or a long one
strings = st.one_of(*[st.text(max_size=40)] * 8, surrogate_text, st.sampled_from(["", "a" * 5000]))
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from(EDGE_INTS),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from(EDGE_FLOATS),
    strings,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(st.one_of(strings, st.sampled_from(["type", "text"])), inner, max_size=4),
    ),
    max_leaves=20,
)
junk_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.one_of(st.sampled_from(["system", "developer", "user", "assistant"]), values)},
        optional={
            "content": st.one_of(
                strings, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": strings})), values
            ),
            "name": st.one_of(strings, values),
            "tool_calls": values,
        },
    ),
    max_size=4,
)
plausible_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": strings},
        optional={"name": strings},
    ),
    min_size=1,
    max_size=3,
)
messages = st.one_of(plausible_messages, plausible_messages, junk_messages)


# Values a real client sends, so that fuzzed requests also get past validation and generate.
PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "n": st.integers(1, 4),
    "best_of": st.integers(1, 4),
    "use_beam_search": st.booleans(),
    "length_penalty": st.floats(-100, 100),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.one_of(strings, st.lists(strings, max_size=3)),
    "stop_token_ids": st.lists(st.integers(0, 4095), max_size=3),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.one_of(st.integers(0, 5), st.booleans()),
    "top_logprobs": st.integers(0, 5),
    "priority": st.integers(-10, 10),
    "cache_salt": strings,
    "max_tokens": st.integers(1, 8),
    "max_completion_tokens": st.integers(1, 8),
    "prompt": st.one_of(strings, st.lists(st.integers(0, 4095), max_size=5), st.lists(strings, max_size=3)),
}


def body_of(fields: frozenset[str], base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """A valid base request with random real fields (plus, now and then, an unknown one) set to a plausible
    value or to anything at all."""
    names = st.sampled_from(sorted(fields) + ["frobnicate"])
    field = names.flatmap(
        lambda name: st.tuples(st.just(name), st.one_of(*[PLAUSIBLE.get(name, values)] * 3, values))
    )
    return st.builds(lambda extra: {**base, **dict(extra)}, st.lists(field, max_size=4))


def nested(depth: int) -> bytes:
    return b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"


raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.sampled_from([b"", b"null", b"NaN", b"[]", b'{"prompt": NaN}', b'{"prompt": "\xed\xa0\x80"}']),
    st.sampled_from(
        [b'{"prompt": "hi", "\\ud800": 1}', b'{"messages": [{"role": "user", "content": "\\udfff"}]}']
    ),
    st.sampled_from([10, 1000, 5000, 100_000]).map(nested),
    st.text(max_size=60).map(lambda t: ('{"prompt": "' + t + '"').encode("utf-8", "surrogatepass")),
)


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path) -> Iterator[ApiServer]:
    # A short context keeps the fuzzed generations short; a small sequence cap keeps them few.
    api = ApiServer(str(tiny_model_dir), ApiConfig(max_seqs_per_request=32), max_model_len=48)
    yield api
    api.close()


def assert_well_formed(reply: HttpReply) -> None:
    assert reply.status < 500, (reply.status, reply.text[:500])
    if reply.status >= 400:
        assert reply.content_type.startswith("application/json"), reply.content_type
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        return
    assert 200 <= reply.status < 300, reply.status
    if reply.content_type.startswith("text/event-stream"):
        assert reply.text.endswith("data: [DONE]\n\n"), reply.text[-300:]
        assert "internal_error" not in reply.text


def assert_still_serving(app: ApiServer) -> None:
    reply = app.post("/v1/completions", {"prompt": "still here", "max_tokens": 2})
    assert reply.status == 200, reply.text


def send(app: ApiServer, route: str, body: Any) -> HttpReply:
    data = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
    return app.request("POST", route, raw=data)


@FUZZ
@given(body=body_of(COMPLETION_FIELDS, {"prompt": "hi", "max_tokens": 3}))
def test_fuzzed_completion_bodies_never_get_a_5xx(app: ApiServer, body: dict[str, Any]) -> None:
    """Guards: length_penalty=1e308 with beam search killed the scheduler; NaN, surrogates and huge ints in
    any field gave 500s."""
    assert_well_formed(send(app, "/v1/completions", body))


@FUZZ
@given(body=body_of(CHAT_FIELDS, {"max_tokens": 3}), chat=messages)
def test_fuzzed_chat_bodies_never_get_a_5xx(app: ApiServer, body: dict[str, Any], chat: Any) -> None:
    """Guards: lone surrogates in chat content or names, non-string names and odd parts gave 500s."""
    assert_well_formed(send(app, "/v1/chat/completions", {"messages": chat, **body}))


@FUZZ
@given(route=st.sampled_from(ROUTES), raw=raw_bodies)
def test_fuzzed_raw_bodies_never_get_a_5xx(app: ApiServer, route: str, raw: bytes) -> None:
    """Guards: JSON nested 100,000 deep raised RecursionError (500); raw surrogate bytes and NaN literals
    got past the parser."""
    assert_well_formed(app.request("POST", route, raw=raw))


@settings(FUZZ, max_examples=60)
@given(route=st.sampled_from(ROUTES), field=st.sampled_from(sorted(COMPLETION_FIELDS | CHAT_FIELDS)))
def test_deeply_nested_values_in_every_field_never_get_a_5xx(app: ApiServer, route: str, field: str) -> None:
    """Guards: a deep value in a field reached code that recursed on it (repr in an error message, say)."""
    raw = b'{"prompt": "hi", "messages": [], "' + field.encode() + b'": ' + b"[" * 900 + b"]" * 900 + b"}"
    assert_well_formed(app.request("POST", route, raw=raw))


def test_the_app_serves_after_the_fuzzing(app: ApiServer) -> None:
    """Guards: a fuzzed request that leaves the app unable to serve (a dead loop, a stuck client)."""
    assert_still_serving(app)
    assert app.get("/health").status == 200
