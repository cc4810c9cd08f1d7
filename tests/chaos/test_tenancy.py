"""Tenancy and authentication under attack (issue 35, items 6 and 7).

Defects guarded, each reproduced on 2a5cb69:
- Prefix-cache probing between users (the class of vLLM's CVE-2025-46570): a second client confirmed another
  client's secret inside a document through `usage.prompt_tokens_details.cached_tokens` (6 of 6 trials), since
  every client shared one prefix cache. Now each API key's requests are salted apart unless the operator opts
  in with --share-prefix-cache-across-keys.
- `chat_template_kwargs` could override the template's globals: `{"bos_token": "AAAA"}` landed in the prompt.
- Wrong API keys were not throttled: 1,000 in 0.9 s, all answered 401. Now 429 with Retry-After past
  --auth-failures-per-minute per client address.
- The dashboard's cookie was HMAC(key, a fixed label): it could not be revoked short of changing the key. Now
  a server-side session with an expiry, ended by sign-out or by removing its key from --api-key-file.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.api.dashboard import COOKIE
from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer, HttpReply
from tests.api.test_errors import assert_error
from tests.e2e.processes import ROOT, Server, free_port, start_server

ALICE = "sk-alice-0123456789"
BOB = "sk-bob-9876543210"
KEY_FILE = f"# tenants\nalice:{ALICE}\n\nbob:{BOB}\n"
# ~250 tokens with the secret near its end: every full block before it is a prefix another tenant could probe
DOCUMENT = " ".join(f"Clause {i}: the parties agree to term {i * 7 % 13}." for i in range(24))


def _request(
    url: str, key: str, prompt: str, method: str = "POST", path: str = "/v1/completions", **extra: Any
) -> tuple[int, dict[str, str], dict[str, Any]]:
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra})
        headers = {"Content-Type": "application/json", "Authorization": "Bearer " + key}
        conn.request(method, path, body, headers)
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), json.loads(reply.read())
    finally:
        conn.close()


def _cached_tokens(url: str, key: str, prompt: str, **extra: Any) -> int:
    status, _, body = _request(url, key, prompt, **extra)
    assert status == 200, body
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def _start_api(server: Server, log_dir: Path, **settings: str) -> tuple[subprocess.Popen, str]:
    """Another api process in front of the same scheduler, with its own settings."""
    port = free_port()
    env = server.engine.env | {"PAGEDSERVE_PORT": str(port)}
    env |= {"PAGEDSERVE_" + k.upper(): v for k, v in settings.items()}
    with open(log_dir / "api-shared.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve.api"], cwd=ROOT, env=env, stdout=log, stderr=log
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120  # a loaded CI machine starts it slowly
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return proc, url
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(
        "the second api did not become healthy:\n" + (log_dir / "api-shared.log").read_text()
    )


@pytest.fixture(scope="module")
def keyed_stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The real api, scheduler and worker, with two keys in a key file; prefix caching on (the default)."""
    log_dir = tmp_path_factory.mktemp("tenancy")
    key_file = log_dir / "keys"
    key_file.write_text(KEY_FILE)
    server = start_server(
        tiny_model_dir, log_dir, api_key_file=str(key_file), num_kv_blocks=256, max_num_seqs=8,
        max_num_batched_tokens=512, max_model_len=512,
    )  # fmt: skip
    yield server
    server.stop()


@pytest.mark.e2e
def test_another_key_cannot_probe_a_cached_prefix_but_the_same_key_reuses_it(keyed_stack: Server) -> None:
    url = keyed_stack.url
    secret = DOCUMENT + " The launch code is 4417."
    assert _cached_tokens(url, ALICE, secret) == 0  # alice's document enters the prefix cache
    assert _cached_tokens(url, BOB, secret) == 0, "bob saw alice's cached prefix"  # the probe learns nothing
    again = _cached_tokens(url, ALICE, secret)
    assert again >= 16 * 10  # alice's own repeat is served from her cache (16-token blocks)
    assert _cached_tokens(url, BOB, secret) == again  # bob's first probe cached his own copy only
    # A request's own cache_salt divides a key's cache further, and is composed with the key, not instead
    assert _cached_tokens(url, ALICE, secret, cache_salt="project-x") == 0
    assert _cached_tokens(url, ALICE, secret, cache_salt="project-x") == again
    assert _cached_tokens(url, BOB, DOCUMENT + " Other.", cache_salt="project-x") == 0
    status, _, body = _request(url, "sk-nobody", secret)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert "alice" in keyed_stack.logs("api") and ALICE not in keyed_stack.logs("api")  # names, not keys


@pytest.mark.e2e
def test_sharing_across_keys_is_the_operators_opt_in(keyed_stack: Server, tmp_path: Path) -> None:
    proc, url = _start_api(keyed_stack, tmp_path, share_prefix_cache_across_keys="1")
    try:
        document = DOCUMENT.replace("Clause", "Article")
        assert _cached_tokens(url, ALICE, document) == 0
        assert _cached_tokens(url, BOB, document) >= 16 * 10  # shared: bob is served from alice's blocks
        # the isolating api keeps its tenants apart from what the sharing one cached. It was idle while the
        # other started: a /health first, since its client would count that quiet spell against the next
        # request as the scheduler's silence (issue 35's false 503 after quiet, fixed apart from this)
        assert keyed_stack.get("/health", timeout=30)[0] == 200
        assert _cached_tokens(keyed_stack.url, BOB, document) == 0
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# ---- chat_template_kwargs may not set what the server gives the template ----


KEY = "sk-tenancy-key"
BEARER = {"Authorization": "Bearer " + KEY}


@pytest.fixture(scope="module")
def keyed(tiny_model_dir: Path) -> Iterator[ApiServer]:
    """The api in front of a fake scheduler, with one key (tests here send no wrong key to it)."""
    api = ApiServer(str(tiny_model_dir), ApiConfig(api_key=KEY))
    yield api
    api.close()


def test_template_kwargs_cannot_override_special_tokens_or_globals(keyed: ApiServer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for name in ("bos_token", "eos_token", "pad_token", "namespace", "range", "messages"):
        body = {"messages": messages, "max_tokens": 2, "chat_template_kwargs": {name: "AAAA"}}
        error = assert_error(keyed.post("/v1/chat/completions", body, BEARER), 400)
        assert error["param"] == "chat_template_kwargs" and name in error["message"]
    body = {"messages": messages, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert keyed.post("/v1/chat/completions", body, BEARER).status == 200  # a template's own variable passes


# ---- wrong keys are throttled per client address ----


@pytest.fixture
def locked(tiny_model_dir: Path) -> Iterator[ApiServer]:
    """Keyed, with the default throttle: a server of its own, since its address ends throttled."""
    api = ApiServer(str(tiny_model_dir), ApiConfig(api_key=KEY))
    yield api
    api.close()


def test_wrong_keys_are_throttled_per_address_with_429_and_retry_after(locked: ApiServer) -> None:
    limit = 30  # the default --auth-failures-per-minute (asserted last, so the old code fails on the 401s)
    statuses = [_request(locked.base_url, f"sk-guess-{i}", "x")[0] for i in range(limit + 20)]
    assert statuses[:limit] == [401] * limit  # the allowance: wrong keys are 401s
    assert statuses[limit:] == [429] * 20  # then every guess is refused before its key is compared
    status, headers, body = _request(locked.base_url, KEY, "x")
    assert status == 429, "the right key from a throttled address must not confirm the guess"
    assert 1 <= int(headers["Retry-After"]) <= 60 // limit + 1
    assert body["error"]["code"] == "rate_limit_exceeded" and set(body["error"]) == {
        "message", "type", "param", "code",
    }  # fmt: skip
    assert locked.get("/health").status == 200  # the open paths are not throttled
    reply = locked.post("/v1/completions", {"prompt": "x"})
    assert_error(reply, 401)  # a request without a key is told so, and costs nothing
    # the dashboard's sign-in counts as the api does
    sign_in = _post_form(locked.port, "/dashboard/login", {"key": "guess"})
    assert sign_in.status == 429 and sign_in.getheader("Retry-After")
    assert sign_in.getheader("Set-Cookie") is None
    assert ApiConfig().auth_failures_per_minute == limit


# ---- dashboard sessions: server-side, ended by sign-out or by removing their key ----


def _post_form(port: int, path: str, form: dict[str, str], cookie: str = "") -> http.client.HTTPResponse:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    headers = {"Content-Type": "application/x-www-form-urlencoded"} | ({"Cookie": cookie} if cookie else {})
    conn.request("POST", path, urllib.parse.urlencode(form), headers)
    reply = conn.getresponse()
    reply.read()
    conn.close()
    return reply


def _sign_in(port: int, key: str) -> str:
    reply = _post_form(port, "/dashboard/login", {"key": key})
    assert reply.status == 303, reply.status
    return reply.getheader("Set-Cookie", "").split(";")[0]  # "pagedserve_dashboard=<token>"


def _page(api: ApiServer, cookie: str) -> HttpReply:
    return api.get("/dashboard", {"Cookie": cookie})


def test_signing_out_revokes_the_session_and_ends_its_event_stream(keyed: ApiServer) -> None:
    locked = keyed
    first, second = _sign_in(locked.port, KEY), _sign_in(locked.port, KEY)
    assert first != second and first.startswith(COOKIE + "=") and KEY not in first
    assert _page(locked, first).status == 200 and _page(locked, second).status == 200
    stream = http.client.HTTPConnection("127.0.0.1", locked.port, timeout=10)
    stream.request("GET", "/dashboard/events", headers={"Cookie": first})
    events = stream.getresponse()
    assert events.status == 200
    while not events.fp.readline().startswith(b"data: "):  # chunked: a size line, then the event
        pass
    assert _post_form(locked.port, "/dashboard/logout", {}, cookie=first).status == 303
    assert _page(locked, first).status == 401  # the same cookie, replayed after sign-out
    assert locked.get("/dashboard/snapshot", {"Cookie": first}).status == 401
    assert _page(locked, second).status == 200  # another browser's session is its own
    started = time.monotonic()
    while events.fp.readline() not in (b"", b"0\r\n"):  # to the last chunk; an open stream times out (10 s)
        pass
    assert time.monotonic() - started < 5, "the event stream outlived its session"
    stream.close()


def test_removing_a_key_from_the_key_file_ends_its_sessions(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("pagedserve.api.auth.RELOAD_CHECK_S", 0.0)  # the file is checked at every request
    key_file = tmp_path / "keys"
    key_file.write_text(KEY_FILE)
    api_server = ApiServer(str(tiny_model_dir), ApiConfig(api_key_file=str(key_file)))
    try:
        alice, bob = _sign_in(api_server.port, ALICE), _sign_in(api_server.port, BOB)
        assert _page(api_server, alice).status == 200 and _page(api_server, bob).status == 200
        key_file.write_text(f"alice:{ALICE}\n")  # bob's key is withdrawn, no restart
        assert _page(api_server, bob).status == 401
        assert _request(api_server.base_url, BOB, "x")[0] == 401
        assert _page(api_server, alice).status == 200
        assert _request(api_server.base_url, ALICE, "x")[0] == 200
    finally:
        api_server.close()
