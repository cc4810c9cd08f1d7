"""What routers ask a replica (api/render.py): the render routes give exactly the token ids the generation
routes submit, in vLLM's shapes; bad bodies get the generation routes' 400s; discovery names the events."""

from __future__ import annotations

import json
from typing import Any

from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer
from tests.api.test_errors import assert_error, send

USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a block table?"}]
ENTRY_KEYS = {
    "request_id",
    "token_ids",
    "features",
    "sampling_params",
    "model",
    "stream",
    "cache_salt",
    "priority",
    "kv_transfer_params",
}  # fmt: skip  (vLLM's GenerateRequest)


def render(server: ApiServer, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    reply = server.post(path, body, headers)
    assert reply.status == 200, reply.text
    return reply.json()


def test_chat_render_is_what_chat_completions_submits(server: ApiServer) -> None:
    body = {"model": "tiny-llama", "messages": USER, "max_tokens": 3, "temperature": 0}
    entry = render(server, "/v1/chat/completions/render", body)
    assert set(entry) == ENTRY_KEYS and entry["request_id"].startswith("chatcmpl-")
    assert server.post("/v1/chat/completions", body).status == 200
    assert entry["token_ids"] == server.fake.submits()[-1].prompt_token_ids
    assert entry["model"] == "tiny-llama" and entry["stream"] is False and entry["cache_salt"] is None
    params = entry["sampling_params"]
    assert params["max_tokens"] == 3 and params["temperature"] == 0 and params["n"] == 1


def test_completion_render_lists_one_entry_per_prompt(server: ApiServer, tokenizer: Any) -> None:
    before = len(server.fake.submits())
    body = {"prompt": ["Hello world", [5, 6, 7]], "max_tokens": 2, "cache_salt": "s"}
    entries = render(server, "/v1/completions/render", body)
    assert [set(e) for e in entries] == [ENTRY_KEYS, ENTRY_KEYS]
    assert entries[0]["token_ids"] == tokenizer("Hello world")["input_ids"]
    assert entries[1]["token_ids"] == [5, 6, 7]
    assert all(e["request_id"].startswith("cmpl-") and e["cache_salt"] == "s" for e in entries)
    assert len({e["request_id"] for e in entries}) == 2
    single = render(server, "/v1/completions/render", {"prompt": "Hello world"})
    assert len(single) == 1 and single[0]["token_ids"] == entries[0]["token_ids"]
    assert len(server.fake.submits()) == before  # rendering submits nothing


def test_render_refuses_what_generation_refuses(server: ApiServer) -> None:
    for path, body, param in [
        ("/v1/chat/completions/render", {"messages": "not a list"}, "messages"),
        ("/v1/chat/completions/render", {"messages": USER, "max_tokens": -1}, "max_tokens"),
        ("/v1/completions/render", {"prompt": [10**9]}, "prompt"),
        ("/v1/completions/render", {"prompt": "x", "n": 0}, "n"),
    ]:
        error = assert_error(server.post(path, body), 400)
        assert error["param"] == param, (path, body, error)
        assert server.post(path.removesuffix("/render"), body).status == 400  # the route it renders for
    assert_error(send(server, "/v1/completions/render", b"{not json"), 400)
    assert_error(server.post("/v1/completions/render", {"prompt": "x", "model": "other"}), 404)


def test_discovery_names_the_replicas_event_sockets(make_server: Any) -> None:
    events = {
        "enable_kv_cache_events": True,
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://127.0.0.1:5600",
    }
    server = make_server(ApiConfig(kv_events_config=json.dumps(events), data_parallel_rank=2))
    sources = server.get("/kv_event_sources").json()
    assert sources == [
        {
            "data_parallel_rank": 2,
            "endpoint": "tcp://127.0.0.1:5559",  # offset by the rank, as the scheduler binds it
            "replay_endpoint": "tcp://127.0.0.1:5602",
            "topic": "",
        }
    ]
    info = server.get("/get_server_info").json()
    assert info["served_model_name"] == "tiny-llama" and info["data_parallel_rank"] == 2
    assert info["kv_event_sources"] == sources and info["context_length"] == 256


def test_discovery_without_events_is_empty(server: ApiServer) -> None:
    assert server.get("/kv_event_sources").json() == []
    assert server.get("/get_server_info").json()["kv_events_config"] is None


def test_render_and_discovery_need_the_api_key(make_server: Any) -> None:
    server = make_server(ApiConfig(api_key="k"))
    body = {"messages": USER}
    assert_error(server.post("/v1/chat/completions/render", body), 401)
    assert_error(server.get("/kv_event_sources"), 401)
    assert_error(server.get("/get_server_info"), 401)
    entry = render(server, "/v1/chat/completions/render", body, {"Authorization": "Bearer k"})
    assert entry["cache_salt"]  # the key's own salt: what its blocks are announced under (api/auth.py)
