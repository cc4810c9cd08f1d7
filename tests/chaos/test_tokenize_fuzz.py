"""Property-based fuzzing of /tokenize and /detokenize (and of the X-Request-Id header), as
test_http_fuzz.py fuzzes the generation endpoints: a 2xx or a 4xx with OpenAI's error body, never a 5xx."""

from __future__ import annotations

import http.client
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.api.tokenization import DETOKENIZE_FIELDS, TOKENIZE_CHAT_FIELDS, TOKENIZE_FIELDS
from tests.api.harness import ApiServer
from tests.chaos.test_http_fuzz import FUZZ, assert_well_formed, messages, raw_bodies, send, strings, values

PLAUSIBLE: dict[str, st.SearchStrategy[Any]] = {
    "prompt": strings,
    "messages": messages,
    "tokens": st.lists(st.integers(-2, 4100), max_size=60),
    "add_special_tokens": st.booleans(),
    "add_generation_prompt": st.booleans(),
    "continue_final_message": st.booleans(),
    "return_token_strs": st.booleans(),
    "model": st.sampled_from(["tiny-llama", "other"]),
}


def bodies(fields: frozenset[str], base: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    names = st.sampled_from(sorted(fields) + ["frobnicate"])
    field = names.flatmap(
        lambda name: st.tuples(st.just(name), st.one_of(*[PLAUSIBLE.get(name, values)] * 3, values))
    )
    return st.builds(lambda extra: {**base, **dict(extra)}, st.lists(field, max_size=4))


@pytest.fixture(scope="module")
def app(tiny_model_dir: Path) -> Iterator[ApiServer]:
    api = ApiServer(str(tiny_model_dir), max_model_len=48)
    yield api
    api.close()


@FUZZ
@given(
    body=st.one_of(bodies(TOKENIZE_FIELDS, {"prompt": "hi"}), bodies(TOKENIZE_CHAT_FIELDS, {"messages": []}))
)
def test_fuzzed_tokenize_bodies_never_get_a_5xx(app: ApiServer, body: dict[str, Any]) -> None:
    assert_well_formed(send(app, "/tokenize", body))


@FUZZ
@given(body=bodies(DETOKENIZE_FIELDS, {"tokens": [1, 2]}))
def test_fuzzed_detokenize_bodies_never_get_a_5xx(app: ApiServer, body: dict[str, Any]) -> None:
    assert_well_formed(send(app, "/detokenize", body))


@FUZZ
@given(route=st.sampled_from(["/tokenize", "/detokenize"]), raw=raw_bodies)
def test_fuzzed_raw_bodies_never_get_a_5xx(app: ApiServer, route: str, raw: bytes) -> None:
    assert_well_formed(app.request("POST", route, raw=raw))


# What HTTP allows in a header value (RFC 9110 field-content: visible ASCII, obs-text, space, tab); aiohttp's
# parser refuses the other bytes itself, before the app sees the request.
FIELD_BYTES = [9, *range(32, 127), *range(128, 256)]


@settings(FUZZ, max_examples=200)
@given(value=st.lists(st.sampled_from(FIELD_BYTES), min_size=1, max_size=300).map(bytes))
def test_fuzzed_request_ids_are_echoed_or_refused(app: ApiServer, value: bytes) -> None:
    """Any header value: the id comes back as sent (stripped), or the request is a 400 under a fresh id."""
    conn = http.client.HTTPConnection("127.0.0.1", app.port, timeout=30)
    try:
        conn.putrequest("POST", "/tokenize")
        conn.putheader("Content-Type", "application/json")
        conn.putheader("X-Request-Id", value)
        body = b'{"prompt": "hi"}'
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        reply = conn.getresponse()
        reply.read()
    finally:
        conn.close()
    echoed = reply.getheader("X-Request-Id") or ""
    stripped = value.strip(b" \t")
    assert reply.status in (200, 400), reply.status
    if reply.status == 200:
        assert echoed == stripped.decode("ascii") or (not stripped and len(echoed) == 32)
    else:
        assert len(echoed) == 32 and reply.getheader("Content-Type", "").startswith("application/json")
