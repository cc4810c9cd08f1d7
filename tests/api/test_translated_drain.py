"""A drain (SIGTERM) ends /v1/responses and /v1/messages streams in their own APIs' error events, and
refuses new requests with their own error bodies; the scheduler is told to abort what they ran."""

from __future__ import annotations

from typing import Any

from tests.api.harness import ApiServer, wait_until
from tests.api.test_shutdown import in_thread, start_drain
from tests.api.translated import sse_events

RESPONSES = {"model": "tiny-llama", "input": "Count", "max_output_tokens": 200, "stream": True}
MESSAGES = {"model": "tiny-llama", "messages": [{"role": "user", "content": "Count"}], "max_tokens": 200}


def test_a_drain_ends_both_streams_with_their_error_events(make_server: Any) -> None:
    server: ApiServer = make_server(step_delay=0.02)
    responses, responses_reply = in_thread(lambda: server.post("/v1/responses", RESPONSES))
    messages, messages_reply = in_thread(lambda: server.post("/v1/messages", {**MESSAGES, "stream": True}))
    assert wait_until(lambda: server.fake.num_running == 2)
    drained = start_drain(server, timeout_s=0.2)
    assert wait_until(lambda: server.post("/v1/messages", MESSAGES).status == 503)
    refused = server.post("/v1/messages", MESSAGES).json()
    assert refused == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": refused["error"]["message"]},
    }
    assert "shutting down" in refused["error"]["message"]
    assert server.post("/v1/responses", RESPONSES).json()["error"]["type"] == "service_unavailable"
    assert drained.result(timeout=10) == 2
    responses.join(10)
    messages.join(10)

    events = [data for _, data in sse_events(responses_reply[0].text)]
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    error, failed = events[-2:]
    assert error["type"] == "error" and "shutting down" in error["message"]
    assert failed["type"] == "response.failed" and failed["response"]["status"] == "failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))

    events = [data for _, data in sse_events(messages_reply[0].text)]
    assert events[0]["type"] == "message_start" and events[-1]["type"] == "error"
    assert (
        events[-1]["error"]["type"] == "overloaded_error"
        and "shutting down" in events[-1]["error"]["message"]
    )
    request_ids = {s.request_id for s in server.fake.submits()}
    assert wait_until(lambda: {a.request_id for a in server.fake.aborts()} == request_ids)
