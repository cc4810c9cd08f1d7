"""`pagedserve serve MODEL [flags]` (or `python -m pagedserve serve ...`): the api, the scheduler and the
worker rank(s) in one command, each supervised (pagedserve/launcher.py); `scripts/start` runs it from a
checkout.

Its flags are the processes' own (common/config.py: ApiConfig, SchedulerConfig, WorkerConfig), each once,
grouped by the process that owns it; a flag that several processes share (`--max-num-seqs`,
`--shutdown-timeout-s`, ...) says which. Every value, from a flag, a PAGEDSERVE_* variable or the default,
reaches the processes as their PAGEDSERVE_* variable, so each process takes exactly the fields its config
has, as under honcho. Values are checked here, before anything starts: a bad one is one line and exit
status 2. MODEL (a directory or a Hugging Face repo id, common/model_source.py) is resolved once here, so a
missing model is one line too, and a download happens once, not in every process; the worker's own checks
(worker/preflight.py) run here too, in a process of their own.

Each `serve` is an instance of its own: its processes meet at ipc:// paths in a private directory made for
it (under $XDG_RUNTIME_DIR, else the temporary directory; removed at exit) unless --scheduler-address or
--worker-address say otherwise, and they share the instance's id (that directory's name), which the api
checks in the scheduler's answers: two servers on one host never cross.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
from dataclasses import fields
from typing import Any

from pagedserve.common.config import (
    DEFAULT_WORKER_ADDRESS,
    ApiConfig,
    SchedulerConfig,
    WorkerConfig,
    add_config_args,
    field_descriptions,
)
from pagedserve.common.interrupts import FORCED_EXIT
from pagedserve.common.model_source import ModelSourceError, resolve_model
from pagedserve.common.preflight import ConfigError, check_bind_address, check_port, flag_named_in
from pagedserve.launcher import Child, Launcher, preflight
from pagedserve.multinode import NodeConfig, node_settings
from pagedserve.replicas.config import ReplicasConfig
from pagedserve.replicas.plan import replicate

PROCESSES: tuple[tuple[str, type], ...] = (
    ("api", ApiConfig),
    ("scheduler", SchedulerConfig),
    ("worker", WorkerConfig),
)
# Fields `serve` sets itself: MODEL is the positional argument, every worker rank gets its own rank, and
# every process the instance's id
NOT_FLAGS = ("model", "rank", "instance_id")
ENV_PREFIX = "PAGEDSERVE_"
# Settings of the launcher itself, not of a process: flags of `serve` that reach no process as a variable
LAUNCHER_CONFIGS: tuple[tuple[str, type], ...] = (
    ("multi-node", NodeConfig),
    ("replica (docs/scaling.md)", ReplicasConfig),
)
# The processes' ZeroMQ addresses: unless given (flag or PAGEDSERVE_*), ipc:// paths in a directory of this
# instance's own, so that any number of servers run side by side on a host
INTERNAL_ADDRESSES = {"scheduler_address": "scheduler.sock", "worker_address": "worker.sock"}
PER_INSTANCE = "pagedserve serve: unless given, an ipc:// path of its own instance"


def owners() -> dict[str, list[str]]:
    """Each config field, and the processes whose config has it."""
    found: dict[str, list[str]] = {}
    for name, cls in PROCESSES:
        for f in fields(cls):
            found.setdefault(f.name, []).append(name)
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve", description="pagedserve: an LLM inference server (paged KV cache, batching)"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser(
        "serve",
        usage="pagedserve serve MODEL [flags]",
        help="serve MODEL over an OpenAI-compatible HTTP api (api, scheduler and worker processes)",
        description=(
            "Starts the api (http://HOST:PORT), the scheduler and --tensor-parallel-size worker ranks, each "
            "restarted when it fails (after a backoff; not after a usage error, exit status 2). SIGTERM or "
            "Ctrl-C drains them: requests in flight get --shutdown-timeout-s to finish. Each flag also "
            "reads its PAGEDSERVE_* variable."
        ),
    )
    serve.set_defaults(command_parser=serve)  # parse-time errors found later still print its usage
    model_env = os.environ.get(ENV_PREFIX + "MODEL")
    serve.add_argument(
        "model",
        metavar="MODEL",
        nargs=None if model_env is None else "?",
        default=model_env,
        help=(
            f"{field_descriptions(WorkerConfig).get('model', '')}; with --revision for a repo id "
            f"(env {ENV_PREFIX}MODEL)"
        ),
    )
    shared = {name: procs for name, procs in owners().items() if len(procs) > 1}
    notes = {name: "used by " + ", ".join(procs) for name, procs in shared.items()}
    notes |= {name: f"{notes[name]}; {PER_INSTANCE}" for name in INTERNAL_ADDRESSES}
    added: set[str] = set(NOT_FLAGS)
    for name, cls in PROCESSES:
        group = serve.add_argument_group(f"{name} flags")
        add_config_args(group, cls, skip=added, notes=notes)
        added |= {f.name for f in fields(cls)}
    for name, cls in LAUNCHER_CONFIGS:
        add_config_args(serve.add_argument_group(f"{name} flags"), cls, skip=added)
    # None: not given, chosen per instance (serve_children)
    serve.set_defaults(**{n: None for n in INTERNAL_ADDRESSES if ENV_PREFIX + n.upper() not in os.environ})
    return parser


def _env_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_children(
    args: argparse.Namespace, parser: argparse.ArgumentParser, runtime_dir: str
) -> tuple[list[Child], dict[str, str]]:
    """The processes to start for `args` and the PAGEDSERVE_* settings they share, their internal addresses
    in `runtime_dir` (this instance's own, its name the instance's id) unless given; exits through
    `parser.error` (one line, status 2) on a value a config refuses, a port or an address that cannot be
    listened on, or a model that cannot be found."""
    try:
        source = resolve_model(args.model, args.revision, weights=args.load_format != "dummy")
    except ModelSourceError as e:
        parser.error(f"--model: {e}")
    values = {name: getattr(args, name) for name in owners() if name not in NOT_FLAGS}
    values["instance_id"] = os.path.basename(runtime_dir)
    given = [name for name in INTERNAL_ADDRESSES if values[name] is not None]
    for name, file in INTERNAL_ADDRESSES.items():
        # across hosts the ranks reach the scheduler over TCP, at an address derived from --dist-init-addr
        across_hosts = name == "worker_address" and args.nnodes > 1
        if values[name] is None:
            values[name] = (
                DEFAULT_WORKER_ADDRESS if across_hosts else f"ipc://{os.path.join(runtime_dir, file)}"
            )
    # the processes load the directory (absolute: wherever they run), with no Hub access of their own
    values |= {"model": os.path.abspath(source.path), "revision": ""}
    if source.repo_id and not values["served_model_name"]:
        values["served_model_name"] = source.repo_id
    num_ranks = values["tensor_parallel_size"]
    try:  # several hosts: the rendezvous and the scheduler's address derived from --dist-init-addr
        node = NodeConfig(**{f.name: getattr(args, f.name) for f in fields(NodeConfig)})
        ranks = node.local_ranks(num_ranks)
        values, scheduler_own = node_settings(node, values)
    except ValueError as e:
        parser.error(f"bad setting: {e}")
    if (
        num_ranks > 1
        and not node.dist_init_addr
        and values["dist_init_method"] == WorkerConfig.dist_init_method
    ):
        values["dist_init_method"] = f"tcp://127.0.0.1:{_free_port()}"  # not a fixed port another group holds
    for _, cls in PROCESSES:  # the processes would refuse these values: say so now, once
        names = [f.name for f in fields(cls) if f.name in values]
        try:
            cls(**{name: values[name] for name in names})
        except ValueError as e:
            flag = flag_named_in(str(e), names)
            parser.error(f"{flag + ': ' if flag else ''}bad setting: {e}")
    try:  # what this host's api and scheduler will listen on (a host other than 0 listens on nothing)
        if node.runs_frontend:
            check_port(values["host"], values["port"])
            for name in given:
                check_bind_address(scheduler_own.get(name, values[name]), "--" + name.replace("_", "-"))
    except ConfigError as e:
        parser.error(str(e))
    env = {ENV_PREFIX + k.upper(): _env_value(v) for k, v in values.items() if v is not None}
    children = []
    if node.runs_frontend:  # host 0 of several: the api and the scheduler; the other hosts, ranks alone
        scheduler_env = {ENV_PREFIX + k.upper(): _env_value(v) for k, v in scheduler_own.items()}
        children = [Child("api", "pagedserve.api"), Child("scheduler", "pagedserve.scheduler", scheduler_env)]
    for rank in ranks:  # ranks other than 0 are stopped by rank 0, then signalled (launcher.py)
        name, after = (f"worker{rank}", "worker" if node.runs_frontend else "") if rank else ("worker", "")
        children.append(Child(name, "pagedserve.worker", {ENV_PREFIX + "RANK": str(rank)}, after=after))
    return children, env


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except SystemExit as e:  # a PAGEDSERVE_* variable that is no value of its flag: a usage error too
        if isinstance(e.code, int) or e.code is None:
            raise
        print(f"pagedserve: error: {e.code}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command != "serve":  # pragma: no cover  (argparse allows only the commands above)
        parser.error(f"unknown command {args.command!r}")
    # this instance's sockets: private to its user (mkdtemp: 0700), removed at exit
    runtime_root = os.environ.get("XDG_RUNTIME_DIR", "")
    runtime_dir = tempfile.mkdtemp(
        prefix="pagedserve-", dir=runtime_root if os.path.isdir(runtime_root) else None
    )
    try:
        children, env = serve_children(args, args.command_parser, runtime_dir)
        # the worker's own checks (the model's limits and family, the device: torch's), in a process of
        # their own so that this one, which stays up as long as the server, never holds torch
        why = preflight("pagedserve.worker.preflight", env | {ENV_PREFIX + "RANK": "0"})
        if why:
            args.command_parser.error(why)
        children, where = replicate(args, children, env)  # N replicas behind a router (pagedserve/replicas)
        launcher = Launcher(
            children,
            env,
            stop_timeout_s=max(args.shutdown_timeout_s, 0.0),
            log_level=args.log_level,
        )
        return launcher.run(
            model=env[ENV_PREFIX + "MODEL"],
            model_name=env.get(ENV_PREFIX + "SERVED_MODEL_NAME", "")
            or os.path.basename(args.model.rstrip("/")),
            instance=env[ENV_PREFIX + "INSTANCE_ID"],
            scheduler_address=env[ENV_PREFIX + "SCHEDULER_ADDRESS"],
            **({"nnodes": str(args.nnodes), "node_rank": str(args.node_rank)} if args.nnodes > 1 else {}),
            **(where if args.node_rank == 0 else {"url": ""}),
        )
    except KeyboardInterrupt:  # Ctrl-C during the checks, before the launcher handles signals
        return FORCED_EXIT
    finally:
        shutil.rmtree(runtime_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
