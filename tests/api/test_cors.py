"""CORS as vLLM's flags configure it: preflights answered (before the API key), origin headers on answers,
and the default that lets only pages of this machine read them."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest

from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer

LOCAL_PAGE = "http://localhost:5173"
USER = [{"role": "user", "content": "hi"}]


async def _send(
    base_url: str, method: str, path: str, headers: dict[str, str], body: Any = None
) -> tuple[int, dict[str, str], str]:
    async with aiohttp.ClientSession() as session:
        async with session.request(method, base_url + path, headers=headers, json=body) as response:
            return response.status, dict(response.headers), await response.text()


def send(server: ApiServer, method: str, path: str, headers: dict[str, str], body: Any = None) -> Any:
    return asyncio.run(_send(server.base_url, method, path, headers, body))


def preflight(server: ApiServer, origin: str, method: str = "POST", headers: str = "") -> Any:
    asked = {"Origin": origin, "Access-Control-Request-Method": method}
    if headers:
        asked["Access-Control-Request-Headers"] = headers
    return send(server, "OPTIONS", "/v1/chat/completions", asked)


def test_a_local_pages_preflight_is_answered(server: ApiServer) -> None:
    status, headers, _ = preflight(server, LOCAL_PAGE, headers="authorization, content-type")
    assert status == 200
    assert headers["Access-Control-Allow-Origin"] == LOCAL_PAGE and headers["Vary"] == "Origin"
    assert "POST" in headers["Access-Control-Allow-Methods"].split(", ")
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert headers["Access-Control-Max-Age"] == "600"
    assert "Access-Control-Allow-Credentials" not in headers
    for origin in ("http://127.0.0.1:8080", "http://[::1]:3000", "https://localhost"):
        assert preflight(server, origin)[0] == 200, origin


@pytest.mark.parametrize(
    "origin", ["https://evil.example", "http://localhost.evil.example", "http://localhost:80x", "null"]
)
def test_another_sites_preflight_is_refused_by_default(server: ApiServer, origin: str) -> None:
    status, headers, text = preflight(server, origin)
    assert status == 400 and "Access-Control-Allow-Origin" not in headers
    assert '"Disallowed CORS origin"' in text  # the API's error body


def test_answers_carry_the_origin_headers_streams_and_errors_included(server: ApiServer) -> None:
    page = {"Origin": LOCAL_PAGE}
    body = {"messages": USER, "max_tokens": 2, "stream": True, "frobnicate": 1}
    status, headers, text = send(server, "POST", "/v1/chat/completions", page, body)
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    assert headers["Access-Control-Allow-Origin"] == LOCAL_PAGE
    assert headers["Access-Control-Expose-Headers"] == "X-Request-Id, X-Ignored-Fields"
    status, headers, _ = send(server, "POST", "/v1/completions", page, {"prompt": ""})
    assert status == 400 and headers["Access-Control-Allow-Origin"] == LOCAL_PAGE
    status, headers, _ = send(server, "GET", "/v1/models", {"Origin": "https://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers  # served; the page cannot read it


def test_options_without_a_request_method_is_not_a_preflight(server: ApiServer) -> None:
    assert send(server, "OPTIONS", "/v1/chat/completions", {"Origin": LOCAL_PAGE})[0] == 405


def test_the_preflight_needs_no_api_key_and_the_401_is_readable(make_server: Any) -> None:
    api = make_server(ApiConfig(api_key="sk-cors"))
    status, headers, _ = preflight(api, LOCAL_PAGE, headers="authorization")
    assert status == 200 and headers["Access-Control-Allow-Origin"] == LOCAL_PAGE
    status, headers, _ = send(api, "POST", "/v1/completions", {"Origin": LOCAL_PAGE}, {"prompt": "a"})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == LOCAL_PAGE
    key = {"Origin": LOCAL_PAGE, "Authorization": "Bearer sk-cors"}
    assert send(api, "POST", "/v1/completions", key, {"prompt": "a", "max_tokens": 1})[0] == 200


def test_vllms_defaults_allow_any_origin(make_server: Any) -> None:
    api = make_server(ApiConfig(allowed_origins='["*"]'))
    status, headers, _ = preflight(api, "https://app.example", "GET", headers="x-custom")
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*" and "Vary" not in headers
    assert headers["Access-Control-Allow-Headers"] == "x-custom"
    assert headers["Access-Control-Allow-Methods"] == "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"


def test_named_origins_methods_headers_and_credentials(make_server: Any) -> None:
    config = ApiConfig(
        allowed_origins='["https://app.example"]',
        allowed_methods='["GET", "POST"]',
        allowed_headers='["Authorization"]',
        allow_credentials=True,
    )
    api = make_server(config)
    status, headers, _ = preflight(api, "https://app.example", headers="Authorization, Content-Type")
    assert status == 200 and headers["Access-Control-Allow-Credentials"] == "true"
    assert headers["Access-Control-Allow-Methods"] == "GET, POST"
    allowed = headers["Access-Control-Allow-Headers"].split(", ")
    assert "authorization" in allowed and "content-type" in allowed
    assert '"Disallowed CORS method"' in preflight(api, "https://app.example", "DELETE")[2]
    assert '"Disallowed CORS headers"' in preflight(api, "https://app.example", headers="x-other")[2]
    assert '"Disallowed CORS origin"' in preflight(api, LOCAL_PAGE)[2]  # the default is replaced


@pytest.mark.parametrize(
    "settings",
    [
        {"allowed_origins": '"*"'},
        {"allowed_methods": "GET"},
        {"allowed_headers": "[1]"},
        {"allowed_origins": '["*"]', "allow_credentials": True},
    ],
)
def test_bad_cors_settings_are_refused_at_start(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="allowed_|allow_credentials"):
        ApiConfig(**settings)
