"""`pagedserve serve --data-parallel-size N` (pagedserve/replicas): the processes and settings it plans, and
the router's command line, without starting anything (tests/e2e/test_replicas.py runs them)."""

from __future__ import annotations

import inspect
import json
import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from pagedserve import cli
from pagedserve.common.config import field_descriptions
from pagedserve.common.kv_events_config import parse_kv_events_config
from pagedserve.launcher import Child
from pagedserve.replicas import plan, router
from pagedserve.replicas.config import ReplicasConfig
from pagedserve.replicas.router import ROUTER_COMMAND_ENV


def _plan(
    model: Path, *flags: str, runtime: Path = Path("/tmp/pagedserve-test-instance")
) -> tuple[list[Child], dict[str, str], dict[str, Any]]:
    parser = cli.build_parser()
    args = parser.parse_args(["serve", str(model), "--port", "9000", *flags])
    # (a launcher that gives each instance a runtime directory for its ipc:// addresses takes it here)
    extra = [str(runtime)] if "runtime_dir" in inspect.signature(cli.serve_children).parameters else []
    children, env = cli.serve_children(args, args.command_parser, *extra)
    planned, about = plan.replicate(args, children, env)
    return planned, env, about


def _router_argv(children: list[Child]) -> list[str]:
    (child,) = [c for c in children if c.name == "router"]
    assert child.module == "pagedserve.replicas.router"
    return json.loads(child.env[ROUTER_COMMAND_ENV])


def _values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


@pytest.fixture
def fake_router(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setattr(plan, "find_router", lambda name: f"/opt/bin/{name}")
    return "/opt/bin/vllm-router"


def test_every_replica_flag_has_a_description() -> None:
    assert all(field_descriptions(ReplicasConfig).get(f.name) for f in fields(ReplicasConfig))
    with pytest.raises(ValueError, match="data_parallel_size"):
        ReplicasConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match="router_args"):
        ReplicasConfig(router_args="--flag 'unclosed")
    with pytest.raises(ValueError, match="router_policy"):
        ReplicasConfig(router_policy="random")  # type: ignore[arg-type]


def test_one_replica_is_the_plain_server(tiny_model_dir: Path) -> None:
    children, _, about = _plan(tiny_model_dir)
    assert [c.name for c in children] == ["api", "scheduler", "worker"]
    assert about == {"url": "http://127.0.0.1:9000"}


def test_each_replica_gets_its_own_ports_rank_and_events(tiny_model_dir: Path, fake_router: str) -> None:
    children, env, about = _plan(tiny_model_dir, "--data-parallel-size", "3", "--device", "cpu")
    names = [c.name for c in children]
    assert names == [f"{p}.{i}" for i in range(3) for p in ("api", "scheduler", "worker")] + ["router"]
    by_rank = [next(c.env for c in children if c.name == f"api.{i}") for i in range(3)]
    assert [e["PAGEDSERVE_PORT"] for e in by_rank] == ["9001", "9002", "9003"]
    assert [e["PAGEDSERVE_DATA_PARALLEL_RANK"] for e in by_rank] == ["0", "1", "2"]
    assert all(e["PAGEDSERVE_HOST"] == "127.0.0.1" for e in by_rank)
    for key in ("PAGEDSERVE_SCHEDULER_ADDRESS", "PAGEDSERVE_WORKER_ADDRESS"):
        assert len({e[key] for e in by_rank} | {env[key]}) == 4  # none shares an address, nor the default
    for i in range(3):  # a replica's processes agree on its settings
        envs = [
            {k: v for k, v in c.env.items() if k != "PAGEDSERVE_RANK"}
            for c in children
            if c.name.endswith(f".{i}")
        ]
        assert len(envs) == 3 and all(e == envs[0] for e in envs)
        assert "CUDA_VISIBLE_DEVICES" not in envs[0]  # on a CPU the replicas share it
    events = parse_kv_events_config(by_rank[0]["PAGEDSERVE_KV_EVENTS_CONFIG"])
    assert (
        events is not None
        and events.enable_kv_cache_events
        and events.endpoint.startswith("tcp://127.0.0.1:")
    )
    assert {e["PAGEDSERVE_KV_EVENTS_CONFIG"] for e in by_rank} == {by_rank[0]["PAGEDSERVE_KV_EVENTS_CONFIG"]}
    argv = _router_argv(children)
    assert argv[0] == fake_router and _values(argv, "--policy") == ["kv_aware"]
    assert _values(argv, "--port") == ["9000"] and _values(argv, "--prometheus-port") != ["29000"]
    urls = [f"http://127.0.0.1:{9001 + i}" for i in range(3)]
    assert argv[argv.index("--worker-urls") + 1 : argv.index("--worker-urls") + 4] == urls
    port = int(events.endpoint.rpartition(":")[2])
    assert _values(argv, "--kv-event-source") == [
        f"{u}=tcp://127.0.0.1:{port + i}" for i, u in enumerate(urls)
    ]
    assert len(_values(argv, "--kv-event-replay-source")) == 3
    assert _values(argv, "--kv-event-model") == ["tiny-llama"] and _values(argv, "--kv-event-block-size") == [
        "16"
    ]
    assert about["replicas"] == urls and about["url"] == "http://127.0.0.1:9000"


def test_the_routers_key_policy_and_extra_arguments(tiny_model_dir: Path, fake_router: str) -> None:
    children, _, _ = _plan(
        tiny_model_dir, "--data-parallel-size", "2", "--device", "cpu", "--api-key", "k",
        "--router-policy", "round_robin", "--router-args", "--health-check-interval-secs 9",
    )  # fmt: skip
    argv = _router_argv(children)
    assert _values(argv, "--api-key") == ["k"] and _values(argv, "--policy") == ["round_robin"]
    assert "--kv-event-source" not in argv  # only kv_aware reads events
    assert argv[-2:] == shlex.split("--health-check-interval-secs 9")  # last, so they win
    assert all(c.env["PAGEDSERVE_KV_EVENTS_CONFIG"] == "" for c in children if c.name != "router")


def test_router_none_runs_the_replicas_alone_on_host(tiny_model_dir: Path) -> None:
    children, _, about = _plan(
        tiny_model_dir,
        "--data-parallel-size",
        "2",
        "--device",
        "cpu",
        "--router",
        "none",
        "--host",
        "0.0.0.0",
    )
    assert "router" not in [c.name for c in children]
    assert {c.env["PAGEDSERVE_HOST"] for c in children} == {"0.0.0.0"}
    assert about["url"].startswith("none") and about["replicas"] == [
        "http://0.0.0.0:9001",
        "http://0.0.0.0:9002",
    ]


def test_gpus_are_sliced_by_tensor_parallel_size(
    tiny_model_dir: Path,
    fake_router: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    children, _, _ = _plan(tiny_model_dir, "--data-parallel-size", "2", "--tensor-parallel-size", "2")
    assert {c.name: c.env["CUDA_VISIBLE_DEVICES"] for c in children if c.name.startswith("worker")} == {
        "worker.0": "4,5", "worker1.0": "4,5", "worker.1": "6,7", "worker1.1": "6,7",
    }  # fmt: skip
    assert next(c for c in children if c.name == "worker1.1").after == "worker.1"  # rank 0 of its own replica
    rendezvous = {c.env["PAGEDSERVE_DIST_INIT_METHOD"] for c in children if c.name.startswith("worker")}
    assert len(rendezvous) == 2
    with pytest.raises(SystemExit) as e:
        _plan(tiny_model_dir, "--data-parallel-size", "3", "--tensor-parallel-size", "2")
    assert e.value.code == 2 and "needs 6 GPUs" in capsys.readouterr().err


def test_a_missing_router_is_one_line_and_status_2(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(plan, "find_router", lambda name: None)
    with pytest.raises(SystemExit) as e:
        _plan(tiny_model_dir, "--data-parallel-size", "2", "--device", "cpu")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "pip install vllm-router" in err


def test_the_router_process_refuses_a_bad_command(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in ("", "[]", '"vllm-router"', "[1]"):
        monkeypatch.setenv(ROUTER_COMMAND_ENV, bad)
        assert router.main() == 2  # a usage error: its supervisor does not restart it
    monkeypatch.setenv(ROUTER_COMMAND_ENV, '["/nonexistent/vllm-router"]')
    assert router.main() == 2
