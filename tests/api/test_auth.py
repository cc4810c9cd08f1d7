"""--api-key and --api-key-file: every route but /health and /metrics needs `Authorization: Bearer <key>`,
else OpenAI's 401; the key file's tenants, the throttle on wrong keys and dashboard sessions (api/auth.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiohttp import web

from pagedserve.api.auth import (
    RELOAD_CHECK_S,
    ApiKeys,
    Auth,
    FailureLimiter,
    KeyFileError,
    address_of,
    parse_key_file,
)
from pagedserve.api.dashboard import Sessions
from pagedserve.common.config import ApiConfig, parse_config
from scripts._servers import ROOT, free_port
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


# ---- several keys (api/auth.py): the key file, tenants, the throttle's table, dashboard sessions ----


def test_the_key_file_names_keys_skips_comments_and_refuses_one_key_under_two_names() -> None:
    tenants = parse_key_file("# ops\nalice:sk-a\n\n  sk-bare  \nhas space:sk-b\nalice:sk-a2\n")
    names = [t.name for t in tenants]
    assert names[0] == "alice" and names[-1] == "alice"  # two keys of one name: one tenant (a rotation)
    assert names[1].startswith("key-") and "sk-bare" not in names[1]  # a bare key: a hash, never the key
    assert len(tenants) == 4  # "has space:sk-b" is no name:key line, so the whole line is a key
    with pytest.raises(KeyFileError, match="line 2"):
        parse_key_file("alice:sk-a\nbob:sk-a\n")


def test_keys_from_the_flag_and_the_file_both_open_the_api(make_server: Any, tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("team-a:sk-team-a\n")
    api = make_server(ApiConfig(api_key=KEY, api_key_file=str(key_file)))
    for key in (KEY, "sk-team-a"):
        assert api.post("/v1/completions", REQUEST, headers=auth_header("Bearer " + key)).status == 200
    assert_error(api.post("/v1/completions", REQUEST, headers=auth_header("Bearer sk-team-b")), 401)
    empty = tmp_path / "empty"
    empty.write_text("# no key yet\n")
    closed = make_server(ApiConfig(api_key_file=str(empty)))  # a key file that lists none opens nothing
    assert_error(closed.post("/v1/completions", REQUEST), 401)


def test_an_unusable_key_file_stops_the_api_at_start(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError, match="--api-key-file"):
        Auth(ApiConfig(api_key_file=str(tmp_path / "missing")))
    (tmp_path / "twice").write_text("a:sk-1\nb:sk-1\n")
    with pytest.raises(KeyFileError, match="two names"):
        Auth(ApiConfig(api_key_file=str(tmp_path / "twice")))


def test_each_tenant_salts_its_requests_apart_unless_sharing_is_on() -> None:
    auth = Auth(ApiConfig(api_key="sk-x"))
    a, b = parse_key_file("a:sk-1\nab:sk-2\n")
    salts = {auth.cache_salt(t, s) for t in (a, b) for s in ("", "b:", ":", "x")}
    assert len(salts) == 8 and "" not in salts and "x" not in salts  # no pair meets another, nor a bare salt
    assert auth.cache_salt(None, "x") == "x"  # no key: one tenant, the request's own salt only
    shared = Auth(ApiConfig(api_key="sk-x", share_prefix_cache_across_keys=True))
    assert shared.cache_salt(a, "x") == shared.cache_salt(b, "x") == "x"


def test_the_throttle_refills_evenly_and_its_table_is_bounded() -> None:
    now = [0.0]
    limiter = FailureLimiter(per_minute=6, max_addresses=3, clock=lambda: now[0])
    for _ in range(6):
        assert limiter.retry_after_s("10.0.0.1") == 0
        limiter.failed("10.0.0.1")
    assert limiter.retry_after_s("10.0.0.1") == 10  # one of 6 per minute comes back every 10 s
    assert limiter.retry_after_s("10.0.0.2") == 0  # per address
    now[0] = 9.5
    assert limiter.retry_after_s("10.0.0.1") == 1
    now[0] = 10.0
    assert limiter.retry_after_s("10.0.0.1") == 0
    for i in range(100):
        limiter.failed(f"10.1.0.{i}")
    assert len(limiter) == 3  # least recently seen forgotten first
    assert FailureLimiter(per_minute=0).retry_after_s("x") == 0  # 0: no limit


def test_an_ipv6_host_is_counted_by_its_64() -> None:
    def address(remote: str) -> str:
        return address_of(cast(web.Request, SimpleNamespace(remote=remote)))

    assert address("2001:db8:1:2:aaaa::1") == address("2001:db8:1:2:bbbb::9") == "2001:db8:1:2::/64"
    assert address("2001:db8:1:3::1") != address("2001:db8:1:2::1")
    assert address("::ffff:10.0.0.7") == address("10.0.0.7") == "10.0.0.7"


def test_dashboard_sessions_expire_and_their_table_is_bounded() -> None:
    now = [0.0]
    sessions = Sessions(max_sessions=4, ttl_s=60.0, clock=lambda: now[0])
    (tenant,) = parse_key_file("ops:sk-ops\n")
    tokens = [sessions.open(tenant) for _ in range(10)]
    assert len(set(tokens)) == 10 and len(sessions) == 4
    assert sessions.find(tokens[0]) is None and sessions.find(tokens[-1]) == tenant  # the oldest ended
    sessions.revoke(tokens[-1])
    assert sessions.find(tokens[-1]) is None and sessions.find(tokens[-2]) == tenant
    now[0] = 60.0
    assert sessions.find(tokens[-2]) is None and len(sessions) == 2  # expired: gone when looked up


def test_the_new_settings_come_from_flags() -> None:
    config = parse_config(
        ApiConfig,
        ["--api-key-file", "/k", "--share-prefix-cache-across-keys", "--auth-failures-per-minute", "5"],
    )
    assert (config.api_key_file, config.share_prefix_cache_across_keys) == ("/k", True)
    assert config.auth_failures_per_minute == 5
    with pytest.raises(ValueError, match="auth_failures_per_minute"):
        ApiConfig(auth_failures_per_minute=-1)


def test_python_m_api_with_an_unusable_key_file_exits_2(tmp_path: Path) -> None:
    """Exit code 2 is a configuration error, which the supervisor does not restart."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    env["PAGEDSERVE_CLUSTER_KEY_FILE"] = str(tmp_path / "cluster_key")
    argv = [
        sys.executable,
        "-m",
        "pagedserve.api",
        "--api-key-file",
        str(tmp_path / "missing"),
        "--port",
        str(free_port()),
    ]
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert done.returncode == 2, done.stderr.decode()[-2000:]
    assert b"api_key_file_unusable" in done.stdout + done.stderr


def test_the_key_file_is_read_again_when_it_changes_and_a_broken_one_keeps_the_last_keys(
    tmp_path: Path,
) -> None:
    now = [0.0]
    key_file = tmp_path / "keys"
    key_file.write_text("a:sk-1\n")
    keys = ApiKeys("", str(key_file), clock=lambda: now[0])
    assert keys.match(b"sk-1") is not None and keys.match(b"sk-2") is None
    key_file.write_text("b:sk-2\n")
    assert keys.match(b"sk-2") is None  # read again at most once per RELOAD_CHECK_S
    now[0] += RELOAD_CHECK_S
    assert keys.match(b"sk-2") is not None and keys.match(b"sk-1") is None  # sk-1 withdrawn
    key_file.write_text("b:sk-2\nc:sk-2\n")  # one key, two names: refused, the last good keys kept
    now[0] += RELOAD_CHECK_S
    assert keys.match(b"sk-2") is not None
    key_file.unlink()
    now[0] += RELOAD_CHECK_S
    assert keys.match(b"sk-2") is not None and keys.enabled
