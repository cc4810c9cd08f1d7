"""pagedserve/multinode.py through `pagedserve serve`'s parser: which processes a host of a multi-node replica
runs, and the rendezvous and scheduler addresses derived from --dist-init-addr.
(tests/e2e/test_multinode_e2e.py runs two "hosts" for real.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from pagedserve.cli import build_parser, main, serve_children
from pagedserve.launcher import Child
from pagedserve.multinode import NodeConfig, split_host_port


def parse(argv: list[str]) -> tuple[list[Child], dict[str, str]]:
    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    return serve_children(args, args.command_parser, "/tmp/pagedserve-test-instance")


def test_host_0_runs_the_api_the_scheduler_and_the_first_ranks(tiny_model_dir: Path) -> None:
    children, env = parse(
        [str(tiny_model_dir), "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "0",
         "--dist-init-addr", "localhost:29500"]
    )  # fmt: skip
    assert [(c.name, c.module, c.after) for c in children] == [
        ("api", "pagedserve.api", ""),
        ("scheduler", "pagedserve.scheduler", ""),
        ("worker", "pagedserve.worker", ""),
        ("worker1", "pagedserve.worker", "worker"),
    ]
    assert [c.env.get("PAGEDSERVE_RANK") for c in children[2:]] == ["0", "1"]
    # the fixed default port is kept when asked for (not replaced by a free one as on one host)
    assert env["PAGEDSERVE_DIST_INIT_METHOD"] == "tcp://localhost:29500"
    # the scheduler binds the host's address (a ZeroMQ bind takes no name); every worker connects by name
    assert children[1].env == {"PAGEDSERVE_WORKER_ADDRESS": "tcp://127.0.0.1:5571"}
    assert env["PAGEDSERVE_WORKER_ADDRESS"] == "tcp://localhost:5571"
    assert "PAGEDSERVE_NNODES" not in env and "PAGEDSERVE_DIST_INIT_ADDR" not in env  # the launcher's own
    assert env["PAGEDSERVE_TP_ALL_REDUCE"] == "nccl"  # auto's one-shot kernels need every rank on one host


def test_another_host_runs_only_its_ranks_connecting_to_host_0(tiny_model_dir: Path) -> None:
    children, env = parse(
        [str(tiny_model_dir), "--tensor-parallel-size", "4", "--nnodes", "2", "--node-rank", "1",
         "--dist-init-addr", "10.0.0.1:29501"]
    )  # fmt: skip
    assert [(c.name, c.env, c.after) for c in children] == [
        ("worker2", {"PAGEDSERVE_RANK": "2"}, ""),  # no rank 0 here to wait for when stopping
        ("worker3", {"PAGEDSERVE_RANK": "3"}, ""),
    ]
    assert env["PAGEDSERVE_DIST_INIT_METHOD"] == "tcp://10.0.0.1:29501"
    assert env["PAGEDSERVE_WORKER_ADDRESS"] == "tcp://10.0.0.1:5571"
    assert env["PAGEDSERVE_TENSOR_PARALLEL_SIZE"] == "4"


def test_a_given_worker_address_is_kept_and_a_wildcard_one_is_reached_at_the_host(
    tiny_model_dir: Path,
) -> None:
    common = [str(tiny_model_dir), "--tensor-parallel-size", "2", "--nnodes", "2", "--dist-init-addr"]
    children, env = parse([*common, "leader.lws:29500", "--worker-address", "tcp://0.0.0.0:6001"])
    assert children[1].env == {"PAGEDSERVE_WORKER_ADDRESS": "tcp://0.0.0.0:6001"}  # the scheduler binds
    assert env["PAGEDSERVE_WORKER_ADDRESS"] == "tcp://leader.lws:6001"
    # (an address of this host: host 0's scheduler must be able to bind it, pagedserve/cli.py checks)
    children, env = parse([*common, "10.0.0.1:29500", "--worker-address", "tcp://127.0.0.1:6002"])
    assert children[1].env == {} and env["PAGEDSERVE_WORKER_ADDRESS"] == "tcp://127.0.0.1:6002"
    _, env = parse([*common, "[fd00::1]:29500", "--node-rank", "1"])
    assert env["PAGEDSERVE_DIST_INIT_METHOD"] == "tcp://[fd00::1]:29500"
    assert env["PAGEDSERVE_WORKER_ADDRESS"] == "tcp://[fd00::1]:5571"


def test_one_host_with_a_dist_init_addr_meets_there(tiny_model_dir: Path) -> None:
    children, env = parse([str(tiny_model_dir), "--tensor-parallel-size", "2", "--dist-init-addr", "h:7"])
    assert [c.name for c in children] == ["api", "scheduler", "worker", "worker1"]
    assert env["PAGEDSERVE_DIST_INIT_METHOD"] == "tcp://h:7"
    assert env["PAGEDSERVE_WORKER_ADDRESS"].startswith("ipc://")  # one host: the instance's own, as without


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2"], "nnodes > 1 needs dist_init_addr"),
        (
            ["--nnodes", "2", "--node-rank", "2", "--dist-init-addr", "h:1"],
            "node_rank must be in [0, nnodes=2)",
        ),
        (["--nnodes", "0"], "nnodes must be in [1, 1024]"),
        (
            ["--nnodes", "2", "--dist-init-addr", "h:1", "--tensor-parallel-size", "3"],
            "must be a multiple of",
        ),
        (["--nnodes", "2", "--dist-init-addr", "h"], "dist_init_addr must be HOST:PORT, got 'h'"),
        (
            [
                "--nnodes",
                "2",
                "--dist-init-addr",
                "h:1",
                "--tensor-parallel-size",
                "2",
                "--tp-all-reduce",
                "fused",
            ],
            "tp_all_reduce fused needs every rank on one host",
        ),
        (["--nnodes", "2", "--dist-init-addr", "h:port"], "dist_init_addr must be HOST:PORT"),
        (
            ["--nnodes", "2", "--tensor-parallel-size", "2", "--dist-init-addr", "nowhere.invalid:1"],
            "does not resolve",
        ),
    ],
)
def test_bad_multinode_settings_fail_before_anything_starts_with_one_line(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["serve", str(tiny_model_dir), *argv])
    assert done.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "usage: pagedserve serve MODEL [flags]" and len(lines) == 2
    assert message in lines[1], lines


def test_local_ranks_split_the_group_evenly() -> None:
    assert [list(NodeConfig(3, r, "h:1").local_ranks(6)) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert list(NodeConfig().local_ranks(4)) == [0, 1, 2, 3]
    assert split_host_port("[::1]:80") == ("::1", 80)
