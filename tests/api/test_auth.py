"""--api-key: every route but /health and /metrics needs `Authorization: Bearer <key>`, else OpenAI's 401."""

from __future__ import annotations

from typing import Any

import pytest

from pagedserve.common.config import ApiConfig, parse_config
from tests.api.harness import ApiServer
from tests.api.test_errors import assert_error

KEY = "sk-test-\u00e9key"  # non-ASCII: compared as bytes, so compare_digest takes it
GOOD = {"Authorization": "Bearer " + KEY}
REQUEST = {"prompt": "abc", "max_tokens": 2}


@pytest.fixture(scope="module")
def locked(tiny_model_dir: Any) -> Any:
    api = ApiServer(str(tiny_model_dir), ApiConfig(api_key=KEY))
    yield api
    api.close()


def auth_header(value: str) -> dict[str, str]:
    return {"Authorization": value.encode().decode("latin-1")}  # http.client sends headers as latin-1


def test_the_right_key_is_served(locked: ApiServer) -> None:
    assert locked.post("/v1/completions", REQUEST, headers=auth_header(GOOD["Authorization"])).status == 200
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert locked.post("/v1/chat/completions", chat, auth_header("bearer " + KEY)).status == 200
    assert locked.get("/v1/models", auth_header(GOOD["Authorization"])).status == 200


def test_a_missing_key_is_openais_401(locked: ApiServer) -> None:
    reply = locked.post("/v1/completions", REQUEST)
    error = assert_error(reply, 401)
    assert error["code"] is None and "didn't provide an API key" in error["message"]
    assert_error(locked.get("/v1/models"), 401)
    assert_error(locked.post("/v1/completions", REQUEST, headers={"Authorization": "Bearer "}), 401)
    assert_error(locked.post("/v1/completions", REQUEST, headers={"Authorization": "Basic abc"}), 401)
    assert_error(locked.post("/v1/edits", {}), 401)  # unknown routes too: nothing is learnt without the key


@pytest.mark.parametrize(
    "value", ["Bearer wrong", "Bearer " + KEY[:-1], "Bearer " + KEY + "x", "Bearer \u00ff"]
)
def test_a_wrong_key_is_openais_401_and_not_echoed(locked: ApiServer, value: str) -> None:
    reply = locked.post("/v1/completions", REQUEST, headers=auth_header(value))
    error = assert_error(reply, 401)
    assert error["code"] == "invalid_api_key" and error["message"] == "Incorrect API key provided."
    assert "wrong" not in reply.text


def test_health_and_metrics_stay_open(locked: ApiServer) -> None:
    assert locked.get("/health").status == 200
    assert locked.get("/metrics").status == 200
    assert 'status="401"' in locked.get("/metrics").text  # refusals are counted


def test_no_key_configured_means_open(server: ApiServer) -> None:
    assert server.post("/v1/completions", REQUEST).status == 200
    assert server.post("/v1/completions", REQUEST, headers={"Authorization": "Bearer anything"}).status == 200


def test_the_key_comes_from_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDSERVE_API_KEY", "from-env")
    assert parse_config(ApiConfig, []).api_key == "from-env"
    assert parse_config(ApiConfig, ["--api-key", "from-flag"]).api_key == "from-flag"
