"""What existing routers and scrapers read from a real pagedserve stack (one per module, KV events on):

- vllm-router (PyPI, Rust; a consumer no one here wrote) routes by our KV events: with a mock replica beside
  the real one behind `vllm-router --policy kv_aware`, the prompt whose prefix the real replica caches goes
  to it, credited with the cached tokens in the router's own decision log;
- /metrics, read with prometheus_client's own parser, has vLLM's families with their labels, moved by
  exactly the requests sent."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.common.kv_events_config import KVEventsConfig
from pagedserve.scheduler.kv_events.publisher import ZmqEventPublisher
from scripts._servers import Honcho, free_port

pytestmark = pytest.mark.e2e
ROUTER = Path(sys.executable).parent / "vllm-router"
BLOCK_SIZE = 16  # the worker's default --block-size


class _Mock(BaseHTTPRequestHandler):
    """A replica that answers everything with "mock", so that a test sees where the router sent a request."""

    def _reply(self, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._reply({})

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._reply(
            {"id": "mock", "object": "text_completion", "model": "mock", "choices": [{"text": "mock"}]}
        )

    def log_message(self, *args: object) -> None:
        pass


def _decisions(log: Path) -> list[dict[str, str]]:
    """The router's kv_aware decision lines, as their key=value fields."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log.read_text(errors="replace"))
    lines = [line for line in text.splitlines() if "KV prefix decision" in line]
    return [dict(re.findall(r'(\w+)="?([^" ]+)"?', line)) for line in lines]


def _post(port: int, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.status, json.loads(reply.read())


def _wait(what: str, check, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout} s"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    events, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    # (no topic: vllm-router's static sources subscribe to vLLM's default, the empty topic)
    config = {"enable_kv_cache_events": True, "endpoint": events, "replay_endpoint": replay}
    log = tmp_path_factory.mktemp("stack") / "stack.log"
    honcho = Honcho(tiny_model_dir, log, kv_events_config=json.dumps(config))
    honcho.events, honcho.replay = events, replay  # type: ignore[attr-defined]
    try:
        honcho.wait_healthy()
        yield honcho
    finally:
        honcho.stop()


def test_vllm_router_credits_the_prefix_a_replica_announced(stack, tmp_path):
    events, replay = stack.events, stack.replay
    mock = ThreadingHTTPServer(("127.0.0.1", 0), _Mock)
    threading.Thread(target=mock.serve_forever, daemon=True).start()
    mock_url = f"http://127.0.0.1:{mock.server_port}"
    mock_events = ZmqEventPublisher(KVEventsConfig(True, endpoint=f"tcp://127.0.0.1:{free_port()}"))
    router_port, router_log = free_port(), tmp_path / "router.log"
    router = None
    try:
        with open(router_log, "wb") as log:
            router = subprocess.Popen(
                [
                    str(ROUTER), "--host", "127.0.0.1", "--port", str(router_port),
                    "--prometheus-port", str(free_port()), "--log-level", "debug",
                    "--worker-urls", mock_url, stack.url, "--policy", "kv_aware",
                    "--kv-event-source", f"{stack.url}={events}",
                    "--kv-event-replay-source", f"{stack.url}={replay}",
                    "--kv-event-source", f"{mock_url}={mock_events.endpoint}",
                    "--kv-event-block-size", str(BLOCK_SIZE), "--kv-event-model", "tiny",
                ],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        _wait(
            "the router's subscription",
            lambda: f"spawned subscriber rank0 (instance {stack.url})" in router_log.read_text(),
        )
        time.sleep(1.0)  # a PUB socket sends nothing to a subscriber whose subscription has not arrived yet
        prompt = list(range(100, 100 + 4 * BLOCK_SIZE))  # four full blocks
        status, _ = stack.post({"prompt": [*prompt, 7], "max_tokens": 1})  # straight to the replica: cached
        assert status == 200
        _wait(
            "the router to read the stored blocks",
            lambda: f"source={stack.url}" in re.sub(r"\x1b\[[0-9;]*m", "", router_log.read_text()),
        )
        status, body = _post(router_port, {"prompt": [*prompt, 8, 9], "max_tokens": 1})
        assert status == 200 and body["model"] != "mock"  # the replica that caches the prefix answered
        status, body = _post(router_port, {"prompt": list(range(900, 900 + 3 * BLOCK_SIZE)), "max_tokens": 1})
        assert status == 200
        first, fresh = _decisions(router_log)  # one decision per request through the router
        assert first["worker"] == stack.url and int(first["credited_prefix_tokens"]) == 4 * BLOCK_SIZE
        assert int(fresh["credited_prefix_tokens"]) == 0  # nothing announced it
    finally:
        if router is not None:
            os.killpg(router.pid, signal.SIGTERM)
            router.wait(10)
        mock.shutdown()
        mock_events.close()


def _scrape(stack) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics by (name, sorted labels), through prometheus_client's parser."""
    with urllib.request.urlopen(stack.url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_have_vllms_families_moved_by_the_requests_sent(stack):
    before = _scrape(stack)
    (model,) = {dict(k[1])["model_name"] for k in before if k[0] == "vllm:num_requests_running"}
    assert model == "tiny-llama"  # the served model's name
    labels = (("engine", "0"), ("model_name", model))
    prompts = [list(range(200 + 100 * i, 200 + 100 * i + n)) for i, n in enumerate((20, 30, 40))]
    for prompt in prompts:
        status, body = stack.post({"prompt": prompt, "max_tokens": 4, "ignore_eos": True})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length"
    after = _scrape(stack)

    def delta(name: str, *extra: tuple[str, str]) -> float:
        key = (name, tuple(sorted((*labels, *extra))))
        return after[key] - before.get(key, 0.0)

    assert delta("vllm:prompt_tokens_total") == 90 and delta("vllm:generation_tokens_total") == 12
    assert delta("vllm:request_success_total", ("finished_reason", "length")) == 3
    assert delta("vllm:request_success_total", ("finished_reason", "stop")) == 0
    assert delta("vllm:time_to_first_token_seconds_count") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 9
    assert delta("vllm:time_per_output_token_seconds_count") == 9
    assert delta("vllm:e2e_request_latency_seconds_count") == 3
    assert delta("vllm:e2e_request_latency_seconds_sum") > 0
    assert delta("vllm:prefix_cache_queries_total") >= 90 - 3  # (a prompt's last token is never looked up)
    assert (
        0
        <= after[("vllm:prefix_cache_hits_total", labels)]
        <= after[("vllm:prefix_cache_queries_total", labels)]
    )
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert after[(name, labels)] == 0  # idle again: nothing runs, waits or holds a block
    le = [dict(k[1])["le"] for k in after if k[0] == "vllm:e2e_request_latency_seconds_bucket"]
    assert le[0] == "0.3" and le[-1] == "+Inf" and len(le) == 22  # vLLM's buckets
    assert any(k[0] == "pagedserve_api_requests_total" for k in after)  # ours are still there
