"""The README's stack (honcho on the Procfile, each process under common.supervisor) killed and stopped
under load, process by process, with the times the issue sets (scripts/chaos.py measures them).

Defects guarded: under `scripts/start`, any one process exiting stopped all three and nothing restarted them;
a dead scheduler went unnoticed (streams hung 70 s and more) and a restarted one never got the worker back;
a killed api's requests ran on to max_tokens holding seats and blocks; SIGTERM cut streams without `[DONE]`.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator

import pytest

from scripts.chaos import CHAOS_SETTINGS, Stack, measure_graceful_stop, measure_kill, measure_slow_reader

pytestmark = pytest.mark.e2e

ERROR_S = 5.0  # in-flight requests end with an error within this of a process exit
HEALTH_S = 2.0  # /health says 503 within this
BACK_S = 30.0  # service is back within this on the CPU


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = Stack(tiny_model_dir, tmp_path_factory.mktemp("chaos") / "honcho.log", **CHAOS_SETTINGS)
    try:
        stack.wait_serving()
        yield stack
    finally:
        stack.stop()


@pytest.mark.parametrize("name", ["worker", "scheduler"])
def test_killed_process_errors_streams_in_seconds_and_is_restarted(stack: Stack, name: str):
    row = measure_kill(stack, name)
    assert row["error_s"] <= ERROR_S, row
    # /health says 503 within 2 s of the kill, unless service was already back by then (no 503 to see)
    if row["health_503_s"] is None:
        assert row["back_s"] <= HEALTH_S, row
    else:
        assert row["health_503_s"] <= HEALTH_S, row
    assert row["back_s"] <= BACK_S, row


def test_killed_api_has_its_requests_aborted_and_blocks_freed(stack: Stack):
    row = measure_kill(stack, "api")
    assert row["error_s"] <= ERROR_S, row
    assert row["back_s"] <= BACK_S, row


def test_stopped_worker_is_declared_dead_by_heartbeat_and_comes_back(stack: Stack):
    pid = stack.pid("worker")
    row = measure_kill(stack, "worker", signal.SIGSTOP)
    assert row["error_s"] <= CHAOS_SETTINGS["heartbeat_timeout_s"] + ERROR_S, row
    assert row["back_s"] <= BACK_S + 10, row  # the heartbeat timeout, then its re-announcement
    assert stack.pid("worker") == pid  # continued, it was reset, not restarted


def test_a_client_that_reads_nothing_has_its_stream_ended_and_memory_stays_flat(stack: Stack):
    """A client that read nothing kept its n=128 request generating at full speed while the api buffered
    (+117 MB in 60 s)."""
    row = measure_slow_reader(stack, seconds=10.0, every_s=1.0)
    assert row["request_ended_by_s"] is not None, row  # aborted, its KV freed
    api_mib = [api for _, api, _ in row["rss_mib_over_time"]]
    assert max(api_mib) - api_mib[0] < 32, row


def test_sigterm_lets_streams_finish_and_exits_zero(stack: Stack):
    """Fails when the drain cuts streams (checked by breaking it); not when the machine is busy: the stop is
    bounded by the chaos stack's drain budget and honcho's kill wait, not by honcho's own 5 s, which on a
    loaded machine cut the streams (issue 36) and killed processes mid-exit."""
    row = measure_graceful_stop(stack)  # last: it stops the stack
    assert row["exit_code"] == {"scheduler": 0, "worker": 0, "api": 0}, stack.logs()[-4000:]
    assert row["streams_completed"] == row["streams"], row
