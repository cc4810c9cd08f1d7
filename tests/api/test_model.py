"""The api's tokenizer comes from its own --model directory, ready before any worker is; the served model's
limits come from the scheduler; a worker that serves another checkpoint gets 503s, not a mismatched
tokenizer. Without --model, the tokenizer is learnt from the first ready worker, as before."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from pagedserve.api.errors import ApiError
from pagedserve.api.model import ModelState
from pagedserve.api.state import STATE
from pagedserve.client import AsyncEngineClient
from pagedserve.common.config import ApiConfig
from pagedserve.common.messages import InfoRequest
from tests.api.fake_scheduler import FakeScheduler
from tests.api.harness import ApiServer, wait_until
from tests.api.test_errors import assert_error

PROMPT = {"prompt": "hello world", "max_tokens": 3}


def test_the_tokenizer_loads_without_asking_the_scheduler(tiny_model_dir: Path, tokenizer: Any) -> None:
    async def scenario() -> None:
        async with FakeScheduler(ready=False) as fake:
            client = AsyncEngineClient(fake.address, str(tiny_model_dir))
            models = ModelState(ApiConfig(model=str(tiny_model_dir)), client)
            try:
                loaded = await models.tokenizer()
                assert fake.received == []  # not even an InfoRequest: no worker needed
                assert loaded.root == os.path.realpath(tiny_model_dir)
                assert loaded.tokenizer("hello")["input_ids"] == tokenizer("hello")["input_ids"]
                assert loaded.tokenizer is await client.get_tokenizer()  # one tokenizer for both sides
                with pytest.raises(ApiError) as info:
                    await models.get()  # the limits still wait for a worker
                assert info.value.status == 503 and "still loading" in info.value.message
                assert any(isinstance(m, InfoRequest) for m in fake.received)
            finally:
                await client.close()

    asyncio.run(scenario())


def test_the_api_loads_its_tokenizer_before_any_worker_is_ready(
    make_server: Any, tiny_model_dir: Path, tokenizer: Any
) -> None:
    server: ApiServer = make_server(config=ApiConfig(model=str(tiny_model_dir)), ready=False)
    models = server._runner.app[STATE].models
    assert wait_until(lambda: models.loaded_tokenizer is not None)
    assert models.loaded is None
    assert server.get("/health").status == 503
    assert_error(server.post("/v1/completions", PROMPT), 503, "service_unavailable")
    server.fake.ready = True
    reply = server.post("/v1/completions", PROMPT)
    assert reply.status == 200, reply.text
    [submit] = server.fake.submits()
    assert submit.prompt_token_ids == tokenizer("hello world")["input_ids"]
    assert server.get("/health").status == 200


def test_without_model_the_tokenizer_is_learnt_from_the_first_ready_worker(
    make_server: Any, tiny_model_dir: Path
) -> None:
    server: ApiServer = make_server(ready=False)  # ApiConfig().model is empty
    models = server._runner.app[STATE].models
    assert_error(server.post("/v1/completions", PROMPT), 503, "service_unavailable")
    assert models.loaded_tokenizer is None  # nothing to load it from yet
    server.fake.ready = True
    assert server.post("/v1/completions", PROMPT).status == 200
    assert models.loaded_tokenizer is not None
    assert models.loaded_tokenizer.root == os.path.realpath(tiny_model_dir)


def test_a_worker_serving_another_checkpoint_gets_503_until_it_matches(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    other = str(tmp_path / "other-model")
    server = ApiServer(other, ApiConfig(model=str(tiny_model_dir)))  # the fake announces `other`
    try:
        error = assert_error(server.post("/v1/completions", PROMPT), 503, "service_unavailable")
        assert other in error["message"] and "same --model" in error["message"]
        assert not server.fake.submits()  # nothing was tokenized for, or sent to, the wrong model
        health = server.get("/health")
        assert health.status == 503 and health.json()["status"] == "misconfigured"
        assert server.get("/v1/models").status == 503
        server.fake.model_root = str(tiny_model_dir)
        assert wait_until(lambda: server.get("/health").status == 200)
        assert server.post("/v1/completions", PROMPT).status == 200
    finally:
        server.close()


def test_a_worker_that_comes_back_with_another_checkpoint_gets_503(
    make_server: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    server: ApiServer = make_server(config=ApiConfig(model=str(tiny_model_dir)))
    assert server.post("/v1/completions", PROMPT).status == 200
    server.fake.model_root = str(tmp_path / "other-model")  # a worker restarted with another --model
    health = server.get("/health")
    assert health.status == 503 and health.json()["status"] == "misconfigured"
    error = assert_error(server.post("/v1/completions", PROMPT), 503, "service_unavailable")
    assert "same --model" in error["message"]
    server.fake.model_root = str(tiny_model_dir)
    assert server.get("/health").status == 200
    assert server.post("/v1/completions", PROMPT).status == 200


def test_an_unloadable_model_directory_is_a_503_that_says_why(make_server: Any, tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    server: ApiServer = make_server(config=ApiConfig(model=missing))
    error = assert_error(server.post("/v1/completions", PROMPT), 503, "service_unavailable")
    assert "could not be loaded" in error["message"] and missing in error["message"]
    health = server.get("/health")
    assert health.status == 503 and health.json()["status"] == "misconfigured"


def test_a_directory_without_a_tokenizer_is_a_503_that_says_why(make_server: Any, tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    server: ApiServer = make_server(config=ApiConfig(model=str(empty)))
    error = assert_error(server.post("/v1/completions", PROMPT), 503, "service_unavailable")
    assert "could not be loaded" in error["message"] and str(empty) in error["message"]


class RecordingLog:
    def __init__(self) -> None:
        self.errors: list[tuple[str, dict[str, Any]]] = []

    def error(self, event: str, **fields: Any) -> None:
        self.errors.append((event, fields))

    def info(self, event: str, **fields: Any) -> None:
        pass


def test_a_mismatch_is_logged_as_an_error_once_per_checkpoint(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    recorded = RecordingLog()
    monkeypatch.setattr("pagedserve.api.model.log", recorded)
    other = str(tmp_path / "other-model")

    async def scenario() -> None:
        async with FakeScheduler(model_root=other) as fake:
            client = AsyncEngineClient(fake.address, str(tiny_model_dir))
            models = ModelState(ApiConfig(model=str(tiny_model_dir)), client)
            try:
                for _ in range(3):
                    with pytest.raises(ApiError) as info:
                        await models.get()
                    assert info.value.status == 503 and other in info.value.message
                fake.model_root = str(tiny_model_dir)
                assert (await models.get()).root == str(tiny_model_dir)
                assert models.misconfiguration == ""
            finally:
                await client.close()

    asyncio.run(scenario())
    [(event, fields)] = recorded.errors
    assert event == "model_mismatch" and fields["worker_model"] == other
    assert fields["api_model"] == os.path.realpath(tiny_model_dir)
