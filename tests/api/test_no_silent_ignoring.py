"""A field the api accepts either has an effect, is refused where it would change the output, or is one that
never changes it: `priority` under fcfs and `stream_options` without `stream` are 400s, as in vLLM; and
GET /version answers the release that runs."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import openai
import pytest

from pagedserve.api.protocol import CHAT_FIELDS, COMPLETION_FIELDS, IGNORED_FIELDS
from tests.api.harness import ApiServer
from tests.api.test_errors import assert_error

USER = [{"role": "user", "content": "hi"}]
ENDPOINTS = [
    ("/v1/completions", {"prompt": "abc", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": USER}),
]
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
def test_a_priority_under_fcfs_is_refused_with_vllms_message(server: ApiServer, path: str, body: Any) -> None:
    before = len(server.fake.submits())
    for priority in (1, -5):
        error = assert_error(server.post(path, {**body, "priority": priority}), 400)
        assert error["message"] == f"Got priority {priority} but Priority scheduling is not enabled."
        assert error["param"] == "priority"
    assert len(server.fake.submits()) == before  # refused before anything was submitted
    assert server.post(path, {**body, "priority": 0}).status == 200  # 0 is fcfs's own order


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
def test_a_priority_under_the_priority_policy_reaches_the_scheduler(
    make_server: Any, path: str, body: Any
) -> None:
    api = make_server(scheduling_policy="priority")
    assert api.post(path, {**body, "priority": -7}).status == 200
    assert api.fake.submits()[-1].priority == -7


def test_the_openai_client_sees_the_priority_refusal(server: ApiServer) -> None:
    with openai.OpenAI(
        base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=30
    ) as client:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="tiny-llama", messages=USER, extra_body={"priority": 2})
    assert "Priority scheduling is not enabled" in info.value.message


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
def test_stream_options_without_stream_are_refused(server: ApiServer, path: str, body: Any) -> None:
    error = assert_error(server.post(path, {**body, "stream_options": {"include_usage": True}}), 400)
    assert error["param"] == "stream_options" and "stream=True" in error["message"]
    both = {**body, "stream": False, "stream_options": {"include_usage": False}}
    assert_error(server.post(path, both), 400)
    assert server.post(path, {**body, "stream_options": {}}).status == 200  # empty: nothing to ignore


IGNORED = {
    "user": "u-1",
    "metadata": {"k": "v"},
    "store": False,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
}


@pytest.mark.parametrize(("path", "body"), ENDPOINTS)
def test_the_ignored_fields_change_nothing(server: ApiServer, path: str, body: Any) -> None:
    """The fake scheduler's output is a function of the prompt and the parameters: equal submissions."""
    assert set(IGNORED) == IGNORED_FIELDS
    assert server.post(path, {**body, "max_tokens": 3}).status == 200
    plain = server.fake.submits()[-1]
    assert server.post(path, {**body, "max_tokens": 3, **IGNORED}).status == 200
    dressed = server.fake.submits()[-1]
    assert (dressed.prompt_token_ids, dressed.params, dressed.priority, dressed.cache_salt) == (
        plain.prompt_token_ids,
        plain.params,
        plain.priority,
        plain.cache_salt,
    )


def test_every_accepted_field_is_in_the_parameter_reference() -> None:
    """README's "Request parameters" lists each field the endpoints accept, so none goes unexplained."""
    text = (REPO / "README.md").read_text().split("## Request parameters", 1)[1]
    rows = [line.split("|")[1] for line in text.splitlines() if line.startswith("| `")]
    listed = {name for cell in rows for name in re.findall(r"`([^`]+)`", cell)}
    missing = (COMPLETION_FIELDS | CHAT_FIELDS | IGNORED_FIELDS) - listed
    assert not missing, f"fields missing from the reference: {sorted(missing)}"


def test_version_is_the_projects(server: ApiServer) -> None:
    with (REPO / "pyproject.toml").open("rb") as f:
        expected = tomllib.load(f)["project"]["version"]
    reply = server.get("/version")
    assert reply.status == 200 and reply.json() == {"version": expected}


def test_version_needs_the_api_key_like_every_route_but_the_probes(tiny_model_dir: Any) -> None:
    from pagedserve.common.config import ApiConfig

    api = ApiServer(str(tiny_model_dir), ApiConfig(api_key="sk-v"))
    try:
        assert_error(api.get("/version"), 401)
        assert api.get("/version", headers={"Authorization": "Bearer sk-v"}).status == 200
    finally:
        api.close()


def test_max_completion_tokens_wins_but_max_tokens_is_still_checked(server: ApiServer) -> None:
    body = {"messages": USER, "max_completion_tokens": 2, "max_tokens": 5}
    assert server.post("/v1/chat/completions", body).json()["usage"]["completion_tokens"] == 2
    error = assert_error(server.post("/v1/chat/completions", {**body, "max_tokens": "five"}), 400)
    assert error["param"] == "max_tokens"
