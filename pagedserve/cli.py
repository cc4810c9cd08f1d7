"""`pagedserve serve MODEL [flags]` (or `python -m pagedserve serve ...`): the api, the scheduler and the
worker rank(s) in one command, under the supervision `scripts/start` gives them (pagedserve/launcher.py).

Its flags are the processes' own (common/config.py: ApiConfig, SchedulerConfig, WorkerConfig), each once,
grouped by the process that owns it; a flag that several processes share (`--max-num-seqs`,
`--shutdown-timeout-s`, ...) says which. Every value, from a flag, a PAGEDSERVE_* variable or the default,
reaches the processes as their PAGEDSERVE_* variable, so each process takes exactly the fields its config
has, as under honcho. Values are checked here, before anything starts: a bad one is one line and exit
status 2. MODEL (a directory or a Hugging Face repo id, common/model_source.py) is resolved once here, so a
missing model is one line too, and a download happens once, not in every process.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
from dataclasses import fields
from typing import Any

from pagedserve.common.config import (
    ApiConfig,
    SchedulerConfig,
    WorkerConfig,
    add_config_args,
    field_descriptions,
)
from pagedserve.common.model_source import ModelSourceError, resolve_model
from pagedserve.launcher import Child, Launcher
from pagedserve.replicas.plan import add_replica_args, replicate

PROCESSES: tuple[tuple[str, type], ...] = (
    ("api", ApiConfig),
    ("scheduler", SchedulerConfig),
    ("worker", WorkerConfig),
)
# Fields `serve` sets itself: MODEL is the positional argument, and every worker rank gets its own rank
NOT_FLAGS = ("model", "rank")
ENV_PREFIX = "PAGEDSERVE_"


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
    added: set[str] = set(NOT_FLAGS)
    for name, cls in PROCESSES:
        group = serve.add_argument_group(f"{name} flags")
        add_config_args(group, cls, skip=added, notes=notes)
        added |= {f.name for f in fields(cls)}
    add_replica_args(serve)  # --data-parallel-size, --router, ... (pagedserve/replicas)
    return parser


def _env_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_children(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> tuple[list[Child], dict[str, str]]:
    """The processes to start for `args` and the PAGEDSERVE_* settings they share; exits through
    `parser.error` (one line, status 2) on a value a config refuses or a model that cannot be found."""
    try:
        source = resolve_model(args.model, args.revision, weights=args.load_format != "dummy")
    except ModelSourceError as e:
        parser.error(str(e))
    values = {name: getattr(args, name) for name in owners() if name not in NOT_FLAGS}
    # the processes load the directory (absolute: wherever they run), with no Hub access of their own
    values |= {"model": os.path.abspath(source.path), "revision": ""}
    if source.repo_id and not values["served_model_name"]:
        values["served_model_name"] = source.repo_id
    num_ranks = values["tensor_parallel_size"]
    if num_ranks > 1 and values["dist_init_method"] == WorkerConfig.dist_init_method:
        values["dist_init_method"] = f"tcp://127.0.0.1:{_free_port()}"  # not a fixed port another group holds
    for _, cls in PROCESSES:  # the processes would refuse these values: say so now, once
        try:
            cls(**{f.name: values[f.name] for f in fields(cls) if f.name in values})
        except ValueError as e:
            parser.error(f"bad setting: {e}")
    env = {ENV_PREFIX + k.upper(): _env_value(v) for k, v in values.items() if v is not None}
    children = [Child("api", "pagedserve.api"), Child("scheduler", "pagedserve.scheduler")]
    for rank in range(num_ranks):  # ranks other than 0 are stopped by rank 0, then signalled (launcher.py)
        name, after = (f"worker{rank}", "worker") if rank else ("worker", "")
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
    children, env = serve_children(args, args.command_parser)
    children, where = replicate(args, children, env)  # N replicas behind a router (pagedserve/replicas)
    launcher = Launcher(
        children,
        env,
        stop_timeout_s=max(args.shutdown_timeout_s, 0.0),
        log_level=args.log_level,
    )
    return launcher.run(
        model=env[ENV_PREFIX + "MODEL"],
        model_name=env.get(ENV_PREFIX + "SERVED_MODEL_NAME", "") or os.path.basename(args.model.rstrip("/")),
        **where,
    )


if __name__ == "__main__":
    sys.exit(main())
