"""`--data-parallel-size N`: the serve command's processes once per replica, and the router before them.

Replica i runs the same api, scheduler and worker ranks as a single server, under the same launcher and
supervisors, with its own:
- api port: --port + 1 + i (on 127.0.0.1 behind a router; on --host with --router none);
- scheduler and worker addresses: fresh 127.0.0.1 ports for tcp://, `_dp<i>` after an ipc:// path;
- torch.distributed rendezvous (a free port) when it has several tensor-parallel ranks;
- --data-parallel-rank i, which its KV events carry and which offsets their ports (vLLM's rule);
- GPUs: CUDA_VISIBLE_DEVICES, the i-th slice of --tensor-parallel-size devices (of the visible ones); on a
  CPU the replicas share it;
- trace files (--kv-trace, --step-trace) with `.dp<i>` added.
Under kv_aware, KV events are turned on (on 127.0.0.1 ports of their own) unless --kv-events-config
already turns them on, and the router subscribes to each replica's.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from typing import Any

from pagedserve.common.kv_events_config import endpoint_for_rank, parse_kv_events_config
from pagedserve.launcher import Child
from pagedserve.replicas.config import ReplicasConfig
from pagedserve.replicas.router import (
    ROUTER_COMMAND_ENV,
    USAGE_ERROR,
    Replica,
    find_router,
    vllm_router_command,
)

P = "PAGEDSERVE_"
ROUTER_MODULE = "pagedserve.replicas.router"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int, tries: int = 100) -> int:
    """The first of `count` consecutive 127.0.0.1 ports that are free now (the KV events' rank offsets)."""
    for _ in range(tries):
        first = _free_port()
        if first + count > 65536:
            continue
        try:
            held = []
            for port in range(first, first + count):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in held:
                s.close()
    raise OSError(f"no {count} consecutive free ports on 127.0.0.1")


def _address(address: str, rank: int) -> str:
    if address.startswith("tcp://"):
        return f"tcp://127.0.0.1:{_free_port()}"
    return f"{address}_dp{rank}"


def _connectable(endpoint: str) -> str:
    """Where a router on this host connects to a PUB socket bound on `endpoint` (a wildcard host)."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:", "tcp://[::]:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint.removeprefix(wildcard)
    return endpoint


def _events_config(env: dict[str, str], size: int, policy: str) -> str:
    """The KV-events config every replica gets (each offsets its ports by its rank)."""
    given = env.get(P + "KV_EVENTS_CONFIG", "")
    config = parse_kv_events_config(given)
    if policy != "kv_aware" or (config is not None and config.enable_kv_cache_events):
        return given
    events, replay = free_port_run(size), free_port_run(size)
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://127.0.0.1:{events}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        }
    )


def _gpu_slices(size: int, tp: int, device: str) -> list[str | None]:
    """Each replica's CUDA_VISIBLE_DEVICES (None: leave it as it is)."""
    if device == "cpu":
        return [None] * size
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(d) for d in range(size * tp)]
    if len(devices) < size * tp:
        raise ValueError(
            f"--data-parallel-size {size} x --tensor-parallel-size {tp} needs {size * tp} GPUs; "
            f"CUDA_VISIBLE_DEVICES names {len(devices)}"
        )
    return [",".join(devices[i * tp : (i + 1) * tp]) for i in range(size)]


def _replica_env(env: dict[str, str], rank: int, port: int, host: str, events: str) -> dict[str, str]:
    mine = {
        P + "PORT": str(port),
        P + "HOST": host,
        P + "SCHEDULER_ADDRESS": _address(env[P + "SCHEDULER_ADDRESS"], rank),
        P + "WORKER_ADDRESS": _address(env[P + "WORKER_ADDRESS"], rank),
        P + "DATA_PARALLEL_RANK": str(rank),
        P + "KV_EVENTS_CONFIG": events,
    }
    if int(env.get(P + "TENSOR_PARALLEL_SIZE", "1")) > 1:
        mine[P + "DIST_INIT_METHOD"] = f"tcp://127.0.0.1:{_free_port()}"
    if env.get(P + "INSTANCE_ID"):  # each replica an instance of its own: no api takes another's scheduler
        mine[P + "INSTANCE_ID"] = f"{env[P + 'INSTANCE_ID']}.dp{rank}"
    for trace in ("KV_TRACE", "STEP_TRACE"):
        if env.get(P + trace):
            mine[P + trace] = f"{env[P + trace]}.dp{rank}"
    return mine


def _fail(message: str) -> None:
    print(f"pagedserve: error: {message}", file=sys.stderr)
    raise SystemExit(USAGE_ERROR)


def replicate(
    args: argparse.Namespace, children: list[Child], env: dict[str, str]
) -> tuple[list[Child], dict[str, Any]]:
    """The processes for `args` (one server's `children`, sharing `env`) and what the launcher logs of where
    they serve. With --data-parallel-size 1 that is the one server on --port. Exits with status 2 and one
    line on a setting that cannot work (the router missing, too few GPUs)."""
    try:
        config = ReplicasConfig(args.data_parallel_size, args.router, args.router_policy, args.router_args)
    except ValueError as e:
        _fail(f"bad setting: {e}")
    url = f"http://{args.host}:{args.port}"
    if config.data_parallel_size == 1:
        return children, {"url": url}
    size, tp = config.data_parallel_size, int(env.get(P + "TENSOR_PARALLEL_SIZE", "1"))
    if args.port + size > 65535:
        _fail(f"--port {args.port}: the replicas take the {size} ports after it, beyond 65535")
    if getattr(args, "nnodes", 1) > 1:
        _fail(
            "--data-parallel-size runs replicas on this host; a replica over several hosts (--nnodes) is one"
        )
    device = env.get(P + "DEVICE", "auto")
    if device not in ("auto", "cuda", "cpu"):
        _fail(f"--device {device} names one device; with --data-parallel-size each replica gets its own")
    binary = None
    if config.router != "none":
        binary = find_router(config.router)
        if binary is None:
            _fail(f"{config.router} is not installed: pip install {config.router} (or --router none)")
    try:
        gpus = _gpu_slices(size, tp, device)
    except ValueError as e:
        _fail(str(e))
    events = _events_config(env, size, config.router_policy if binary else "")
    host = args.host if binary is None else "127.0.0.1"  # behind a router, the replicas stay local
    planned: list[Child] = []
    replicas: list[Replica] = []
    for rank in range(size):
        mine = _replica_env(env, rank, args.port + 1 + rank, host, events)
        if gpus[rank] is not None:
            mine["CUDA_VISIBLE_DEVICES"] = gpus[rank]
        for child in children:
            after = f"{child.after}.{rank}" if child.after else ""
            planned.append(Child(f"{child.name}.{rank}", child.module, child.env | mine, after=after))
        replicas.append(_replica(host, args.port + 1 + rank, events, rank))
    about: dict[str, Any] = {"replicas": [r.url for r in replicas]}
    if binary is None:
        return planned, about | {"url": "none: --router none, the replicas serve alone"}
    model_name = env.get(P + "SERVED_MODEL_NAME") or os.path.basename(env[P + "MODEL"].rstrip("/"))
    argv = vllm_router_command(
        binary, args.host, args.port, _free_port(), replicas, config.router_policy,
        block_size=int(env.get(P + "BLOCK_SIZE", "16")), model_name=model_name,
        api_key=env.get(P + "API_KEY", ""), log_level=env.get(P + "LOG_LEVEL", "info"),
        extra_args=config.router_args,
    )  # fmt: skip
    planned.append(Child("router", ROUTER_MODULE, {ROUTER_COMMAND_ENV: json.dumps(argv)}))
    return planned, about | {"url": url, "router": config.router, "policy": config.router_policy}


def _replica(host: str, port: int, events: str, rank: int) -> Replica:
    config = parse_kv_events_config(events)
    url = f"http://{host}:{port}"
    if config is None or not config.enable_kv_cache_events or config.resolved_publisher != "zmq":
        return Replica(url)
    replay = config.replay_endpoint
    return Replica(
        url,
        _connectable(endpoint_for_rank(config.endpoint, rank)),
        _connectable(endpoint_for_rank(replay, rank)) if replay else None,
    )
