"""The router in front of the replicas: its command line, and the process the supervisor runs for it.

vllm-router (0.1.17) is told everything statically: the replicas' URLs, and for kv_aware each replica's
KV-event sockets (`--kv-event-source URL=tcp://...`, its replay socket, the block size, the model), because
its discovery (/get_server_info, /kv_event_sources) starts no subscriber. It checks each replica's GET
/health every HEALTH_INTERVAL_S: after HEALTH_FAILURES failures in a row a replica is out of rotation, after
one success it is back. A request that fails to reach a replica (refused connection, 5xx) is retried on
another, its own default retry policy. Its Prometheus port defaults to 29000, which a second router on the
host would hold: the launcher gives it a free one.

`python -m pagedserve.replicas.router` replaces itself (exec) with the command in PAGEDSERVE_ROUTER_COMMAND
(JSON, set by the launcher), so the supervisor's signals reach the router itself.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

ROUTER_COMMAND_ENV = "PAGEDSERVE_ROUTER_COMMAND"
HEALTH_INTERVAL_S = 2  # between the router's /health probes of each replica
HEALTH_FAILURES = 2  # failed probes in a row that take a replica out of rotation
STARTUP_TIMEOUT_S = 3600  # the router waits this long for the replicas to load their models
USAGE_ERROR = 2


@dataclass(frozen=True)
class Replica:
    """What the router needs to know of one replica."""

    url: str  # its api, http://127.0.0.1:PORT
    events: str | None = None  # its KV-event PUB socket, to connect to (kv_aware)
    replay: str | None = None  # its replay socket


def find_router(name: str = "vllm-router") -> str | None:
    """The router's executable: beside this Python's (a virtual environment not activated), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def vllm_router_command(
    binary: str,
    host: str,
    port: int,
    metrics_port: int,
    replicas: list[Replica],
    policy: str,
    *,
    block_size: int,
    model_name: str,
    api_key: str = "",
    log_level: str = "info",
    extra_args: str = "",
) -> list[str]:
    """vllm-router's argv for `replicas` under `policy`; `extra_args` come last, so they win."""
    argv = [
        binary, "--host", host, "--port", str(port),
        "--worker-urls", *[r.url for r in replicas],
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--worker-startup-timeout-secs", str(STARTUP_TIMEOUT_S), "--worker-startup-check-interval", "1",
        "--health-check-interval-secs", str(HEALTH_INTERVAL_S),
        "--health-failure-threshold", str(HEALTH_FAILURES), "--health-success-threshold", "1",
        "--log-level", log_level if log_level in ("debug", "info", "warning", "error") else "info",
    ]  # fmt: skip
    if policy == "kv_aware":
        for r in replicas:
            if r.events:
                argv += ["--kv-event-source", f"{r.url}={r.events}"]
            if r.replay:
                argv += ["--kv-event-replay-source", f"{r.url}={r.replay}"]
        argv += ["--kv-event-block-size", str(block_size), "--kv-event-model", model_name]
    if api_key:  # the key it sends the replicas on its own requests; clients' keys it passes through
        argv += ["--api-key", api_key]
    return argv + shlex.split(extra_args)


def main() -> int:
    text = os.environ.get(ROUTER_COMMAND_ENV, "")
    try:
        argv = json.loads(text)
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ValueError("not a list of strings")
    except ValueError as e:
        print(f"pagedserve.replicas.router: {ROUTER_COMMAND_ENV} must be a JSON argv: {e}", file=sys.stderr)
        return USAGE_ERROR
    try:
        os.execv(argv[0], argv)
    except OSError as e:  # gone since the launcher looked: restarting would fail the same way
        print(f"pagedserve.replicas.router: cannot run {argv[0]}: {e}", file=sys.stderr)
    return USAGE_ERROR


if __name__ == "__main__":
    sys.exit(main())
