"""`pagedserve serve --data-parallel-size 3`: three tiny-model replicas behind vllm-router (kv_aware), on CPU.

The multi-turn chat workload of scripts/bench_replicas.py through the router with the openai client (19
conversations x 4 turns sharing a system prompt, one request at a time). Checked:
- greedy outputs through the router equal those of one replica serving everything;
- kv_aware's summed prefix-cache hit rate (the replicas' vllm:prefix_cache_hits / queries) is within 10% of
  that one replica's (round robin's, well under half of it on this workload, is measured by the script:
  a third run would take too long for CI);
- a replica's api killed between two turns and kept down for a while: no request fails (the router
  retries those it sent there on another replica), the router takes it out of rotation within its health
  probes, and once its supervisor has restarted it the router puts it back and sends it requests again.
Each run salts its requests (`cache_salt`) so that none finds another run's blocks."""

from __future__ import annotations

import json
import os
import signal
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.replicas.router import HEALTH_FAILURES, HEALTH_INTERVAL_S
from scripts.bench_replicas import Stack, client, hit_rate, http_status, run_workload, wait_for

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log = tmp_path_factory.mktemp("replicas") / "serve.log"
    # debug: the router logs its health changes; 512 blocks of 16 per replica hold every conversation
    stack = Stack(tiny_model_dir, log, 3, "--device", "cpu", "--num-kv-blocks", "512", "--log-level", "debug")
    try:
        stack.wait_ready()
        yield stack
    finally:
        stack.stop()


def test_kv_aware_hits_the_cache_as_one_replica_would(stack: Stack) -> None:
    kv_aware, routed = hit_rate(stack.replicas, lambda: run_workload(client(stack.url), "kv"))
    one = client(stack.replicas[0])
    alone, expected = hit_rate(stack.replicas, lambda: run_workload(one, "one"))
    print(f"prefix-cache hit rate: kv_aware {kv_aware:.3f}, one replica {alone:.3f}")
    assert routed == expected  # greedy: which replica ran a request changes nothing of its output
    assert abs(kv_aware - alone) <= 0.1 * alone


def _api_pid(supervisor: int) -> int:
    """The process that the supervisor `supervisor` runs."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    assert len(children) == 1, children
    return int(children[0])


def _requests(url: str, route: str) -> float:
    """Requests to `route` that the replica's api has answered since it started."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pagedserve_api_requests_total" and s.labels.get("route") == route
    )


def _router_sees_healthy(stack: Stack, url: str) -> bool:
    """Whether vllm-router counts `url` in rotation (its GET /workers)."""
    with urllib.request.urlopen(stack.url + "/workers", timeout=5) as reply:
        workers = json.loads(reply.read())["workers"]
    return next(w["is_healthy"] for w in workers if w["url"] == url)


def test_a_killed_replica_is_routed_around_then_back_in_rotation(stack: Stack) -> None:
    victim = stack.replicas[1]
    supervisor = stack.supervisors()["api.1"]
    out_of_rotation_s = HEALTH_INTERVAL_S * (HEALTH_FAILURES + 1) + 5  # probes, and the probe's own timeout

    def outage(turn: int) -> None:
        if turn == 1:  # the api dies, and its supervisor (stopped) restarts it only when let go
            os.kill(supervisor, signal.SIGSTOP)
            os.kill(_api_pid(supervisor), signal.SIGKILL)
            wait_for("the api to die", lambda: http_status(victim + "/health") == 0, 10)
        if turn == 2:
            wait_for(
                "the router to drop it", lambda: not _router_sees_healthy(stack, victim), out_of_rotation_s
            )
            os.kill(supervisor, signal.SIGCONT)
            wait_for("the supervisor's restart", lambda: http_status(victim + "/health") == 200, 60)
            wait_for(
                "the router to take it back", lambda: _router_sees_healthy(stack, victim), out_of_rotation_s
            )

    try:
        # turn 1 is sent while the replica is dead and before the router has noticed: those it places there
        # fail to connect and are retried on another replica; none may fail (run_workload raises)
        replies = run_workload(client(stack.url), "kill", conversations=6, turns=3, before_turn=outage)
    finally:
        os.kill(supervisor, signal.SIGCONT)
    assert [len(r) for r in replies] == [3] * 6
    served = _requests(victim, "/v1/completions")
    fresh = client(stack.url)

    def fresh_request(i: int) -> None:  # nothing of it is cached anywhere: kv_aware weighs the queues alone
        prompt = [1000 + 37 * i + j for j in range(20)]
        fresh.completions.create(
            model="tiny-llama", prompt=prompt, max_tokens=16, extra_body={"ignore_eos": True}
        )

    with ThreadPoolExecutor(9) as pool:  # sent together, they are spread over every replica in rotation
        list(pool.map(fresh_request, range(9)))
    assert _requests(victim, "/v1/completions") > served
