"""/tokenize, /detokenize, /version, X-Request-Id and `priority` through the real processes, with the
scheduler under --scheduling-policy priority (the api learns the policy from the scheduler's InfoReply)."""

from __future__ import annotations

import tomllib
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from tests.e2e.processes import start_server

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    srv = start_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        num_kv_blocks=64,
        max_num_seqs=8,
        max_model_len=256,
        scheduling_policy="priority",
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def test_tokenize_matches_the_tokenizer_and_the_served_prompt(
    http: httpx.Client, tiny_model_dir: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    text = "naïve café: the block table"
    answer = http.post("/tokenize", json={"prompt": text}).json()
    assert answer["tokens"] == tokenizer(text)["input_ids"] and answer["max_model_len"] == 256
    assert http.post("/detokenize", json={"tokens": answer["tokens"]}).json()["prompt"] == tokenizer.decode(
        answer["tokens"]
    )
    chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
    reply = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).json()
    assert chat["count"] == reply["usage"]["prompt_tokens"]
    completion = http.post("/v1/completions", json={"prompt": chat["tokens"], "max_tokens": 2}).json()
    assert completion["usage"]["prompt_tokens"] == chat["count"]


def test_priority_is_served_under_the_priority_policy(http: httpx.Client) -> None:
    for priority in (-3, 0, 4):
        reply = http.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2, "priority": priority})
        assert reply.status_code == 200, reply.text


def test_request_id_and_version(http: httpx.Client) -> None:
    reply = http.post(
        "/v1/completions", json={"prompt": "abc", "max_tokens": 2}, headers={"X-Request-Id": "e2e-1"}
    )
    assert reply.headers["x-request-id"] == "e2e-1" and reply.json()["id"] == "cmpl-e2e-1"
    with http.stream(
        "POST",
        "/v1/chat/completions",
        json={"messages": MESSAGES, "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "e2e-2"},
    ) as stream:
        assert stream.headers["x-request-id"] == "e2e-2" and '"chatcmpl-e2e-2"' in stream.read().decode()
    with (Path(__file__).resolve().parents[2] / "pyproject.toml").open("rb") as f:
        version = tomllib.load(f)["project"]["version"]
    assert http.get("/version").json() == {"version": version}
