"""Hostile bodies are normal input: whatever JSON a client sends, the Responses and Messages translators
either give a chat body or refuse with an ApiError (a 400 in the API's shape), never another exception."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.api.errors import ApiError
from pagedserve.api.messages.request import MESSAGES_FIELDS, chat_body
from pagedserve.api.responses.request import RESPONSES_FIELDS, translate
from tests.api.harness import ApiServer

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
)
KEYS = st.sampled_from(["type", "role", "content", "text", "name", "call_id", "output", "arguments", "id"])
KEYS |= st.sampled_from(
    ["input", "tool_use_id", "input_schema", "thinking", "budget_tokens", "format", "schema"]
)
KINDS = st.sampled_from(["message", "function_call", "function_call_output", "reasoning", "text", "tool_use"])
KINDS |= st.sampled_from(["tool_result", "thinking", "input_text", "output_text", "function", "json_schema"])
JSON = st.recursive(
    SCALARS | KINDS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS, inner, max_size=5),
    max_leaves=20,
)


ITEMS = st.lists(st.dictionaries(KEYS, JSON, max_size=5), min_size=1, max_size=4)  # messages, items, blocks


def body(fields: frozenset[str], listed: str) -> st.SearchStrategy[dict[str, Any]]:
    """Bodies of the endpoint's fields; the list field (`input`, `messages`) mostly a list of objects."""
    other = st.dictionaries(st.sampled_from(sorted(fields - {listed})), JSON, max_size=5)
    return st.builds(lambda rest, items: {**rest, listed: items}, other, ITEMS | JSON)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    body=body(RESPONSES_FIELDS, "input"),
    history=st.lists(st.just({"role": "user", "content": "hi"}), max_size=2),
)
def test_responses_bodies_translate_or_are_refused(
    body: dict[str, Any], history: list[dict[str, Any]]
) -> None:
    try:
        asked = translate(body, history)
    except ApiError as e:
        assert e.status == 400 and e.message
        return
    assert asked.chat_body["messages"] and isinstance(asked.store, bool)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=body(MESSAGES_FIELDS, "messages"), counting=st.booleans())
def test_messages_bodies_translate_or_are_refused(body: dict[str, Any], counting: bool) -> None:
    try:
        chat = chat_body(body, counting)
    except ApiError as e:
        assert e.status == 400 and e.message
        return
    assert chat["messages"]


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(responses=body(RESPONSES_FIELDS, "input"), messages=body(MESSAGES_FIELDS, "messages"))
def test_no_body_is_a_server_error(
    server: ApiServer, responses: dict[str, Any], messages: dict[str, Any]
) -> None:
    """Through the whole api (parse_chat, the template, the fake scheduler): an answer or a 4xx."""
    for path, sent in (("/v1/responses", responses), ("/v1/messages", messages)):
        reply = server.post(path, {**sent, "model": "tiny-llama", "stream": False})
        assert reply.status in (200, 400), (path, sent, reply.text)
        if path == "/v1/messages" and reply.status != 200:
            assert reply.json()["type"] == "error"
