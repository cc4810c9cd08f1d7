"""/dashboard through HTTP in front of a fake scheduler: the page, the event stream relaying the scheduler's
snapshots, the sign-in with --api-key (cookie or bearer, never the key in a URL), --no-dashboard, static files
and the vendored Chart.js's hash."""

from __future__ import annotations

import hashlib
import http.client
import json
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from pagedserve.api.dashboard import COOKIE, STATIC_DIR
from pagedserve.common.config import ApiConfig, parse_config
from pagedserve.common.kv_view import snapshot_to_dict
from tests.api.harness import ApiServer
from tests.scheduler.conftest import make_harness

KEY = "sk-dash-\u00e9"
CHART_SHA256 = "fbc45926e6b46845a0f905552a0e0b1331049bff1115ecf94dbe0904d895e710"


def _busy_snapshot():
    h = make_harness(num_blocks=32, block_size=4)
    h.submit("shared-prefix", list(range(1, 20)), max_tokens=6, n=4, seed=1)
    h.step()
    h.step()
    return h.scheduler.kv_snapshot(4096)


def _first_event(port: int, headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, Any] | None]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/dashboard/events", headers=headers or {})
        reply = conn.getresponse()
        if reply.status != 200:
            return reply.status, reply.getheader("Content-Type", ""), json.loads(reply.read())
        line = reply.fp.readline().decode()
        while not line.startswith("data: "):
            line = reply.fp.readline().decode()
        return reply.status, reply.getheader("Content-Type", ""), json.loads(line[len("data: ") :])
    finally:
        conn.close()


@pytest.fixture(scope="module")
def open_api(tiny_model_dir: Path) -> Any:
    api = ApiServer(str(tiny_model_dir))
    api.fake.kv_snapshot = _busy_snapshot()
    yield api
    api.close()


@pytest.fixture(scope="module")
def locked(tiny_model_dir: Path) -> Any:
    api = ApiServer(str(tiny_model_dir), ApiConfig(api_key=KEY))
    yield api
    api.close()


def test_page_and_its_files_are_served(open_api: ApiServer) -> None:
    page = open_api.get("/dashboard")
    assert page.status == 200 and page.content_type.startswith("text/html")
    for src in ("/dashboard/static/dashboard.js", "/dashboard/static/chart-3.9.1.min.js"):
        assert src in page.text
        reply = open_api.get(src)
        assert reply.status == 200 and reply.content_type == "text/javascript"
    assert open_api.get("/dashboard/static/dashboard.css").content_type == "text/css"
    for bad in ("..%2Fserver.py", ".hidden.js", "nothing.js", "index.py"):
        assert open_api.get("/dashboard/static/" + bad).status == 404


def test_event_stream_relays_the_schedulers_snapshot(open_api: ApiServer) -> None:
    status, content_type, event = _first_event(open_api.port)
    assert status == 200 and content_type == "text/event-stream"
    assert event == json.loads(json.dumps(snapshot_to_dict(open_api.fake.kv_snapshot)))
    assert event["blocks_shared"] > 0 and event["requests"][0]["request_id"] == "shared-prefix"
    one = open_api.get("/dashboard/snapshot?cells=3").json()
    assert one["blocks_used"] == event["blocks_used"]
    for bad in ("0", "x", "70000", "-1"):
        assert open_api.get(f"/dashboard/snapshot?cells={bad}").status == 400


def test_the_key_guards_the_dashboard_and_the_sign_in_sets_a_cookie(locked: ApiServer) -> None:
    page = locked.get("/dashboard")
    assert page.status == 401 and 'name="key"' in page.text  # the sign-in form
    assert locked.get("/dashboard/static/dashboard.js").status == 401
    assert _first_event(locked.port)[0] == 401
    assert locked.get("/dashboard/snapshot").status == 401
    assert locked.get("/dashboard/snapshot?key=" + urllib.parse.quote(KEY)).status == 401  # no key in URLs

    def sign_in(key: str) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", locked.port, timeout=10)
        body = urllib.parse.urlencode({"key": key})
        conn.request("POST", "/dashboard/login", body, {"Content-Type": "application/x-www-form-urlencoded"})
        reply = conn.getresponse()
        reply.read()
        conn.close()
        return reply

    wrong = sign_in("sk-wrong")
    assert wrong.status == 401 and wrong.getheader("Set-Cookie") is None
    right = sign_in(KEY)
    cookie = right.getheader("Set-Cookie")
    assert right.status == 303 and right.getheader("Location") == "/dashboard"
    token = cookie.removeprefix(COOKIE + "=").split(";")[0]
    assert cookie.startswith(COOKIE + "=") and len(token) >= 40 and KEY not in cookie
    assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
    jar = {"Cookie": f"{COOKIE}={token}"}
    assert locked.get("/dashboard", jar).status == 200
    assert locked.get("/dashboard/static/dashboard.js", jar).status == 200
    assert _first_event(locked.port, jar)[0] == 200
    assert locked.get("/dashboard", {"Cookie": f"{COOKIE}={token[:-1]}x"}).status == 401
    bearer = {"Authorization": "Bearer " + KEY.encode().decode("latin-1")}
    assert locked.get("/dashboard/snapshot", bearer).status == 200
    # the dashboard's cookie opens the dashboard only
    assert locked.get("/v1/models", jar).status == 401


def test_no_dashboard_turns_it_off(tiny_model_dir: Path) -> None:
    assert parse_config(ApiConfig, ["--no-dashboard"]).dashboard is False
    api = ApiServer(str(tiny_model_dir), ApiConfig(dashboard=False))
    try:
        assert api.get("/dashboard").status == 404
        assert api.get("/dashboard/events").status == 404
    finally:
        api.close()


def test_vendored_chart_js_is_the_pinned_file_with_its_licence() -> None:
    data = (STATIC_DIR / "chart-3.9.1.min.js").read_bytes()
    assert hashlib.sha256(data).hexdigest() == CHART_SHA256
    assert data.startswith(b"/*!\n * Chart.js v3.9.1")
    assert "Permission is hereby granted" in (STATIC_DIR / "chart.js-LICENSE.txt").read_text()
