"""A setting that cannot work stops `pagedserve serve` and each process before anything starts: one line
naming the flag, exit status 2 (which common/supervisor.py never restarts).

Defects guarded (issue 36, against 2a5cb69): `--max-model-len` beyond the model, a `--tensor-parallel-size`
that does not divide the heads, a device this host lacks, an unsupported model_type and a port in use each
crash-looped under the supervisor instead; `--port 99999` logged :99999 and listened on 34463.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedserve.common.config import WorkerConfig, parse_config
from pagedserve.common.preflight import ConfigError, check_bind_address, check_port, flag_named_in
from scripts._servers import ROOT

SERVE_TIMEOUT_S = 300.0  # a bound, not an expectation: a run that starts the server instead times out


@pytest.fixture(scope="module")
def held_port() -> Iterator[int]:
    """A port that another server listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.fixture(scope="module")
def gpt2_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint, labelled as a family the worker does not run."""
    path = tmp_path_factory.mktemp("unsupported") / "gpt2"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (path / "config.json").write_text(json.dumps(config))
    return path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    return env | {"PAGEDSERVE_DEVICE": "cpu", "PYTHONPATH": str(ROOT)}


def _run(argv: list[str]) -> tuple[int, list[str]]:
    """Runs `python -m ARGV` to its end; its status and stderr lines, without log lines."""
    done = subprocess.run(
        [sys.executable, "-m", *argv], cwd=ROOT, env=_env(), capture_output=True, text=True,
        timeout=SERVE_TIMEOUT_S,
    )  # fmt: skip
    return done.returncode, [line for line in done.stderr.strip().splitlines() if not line.startswith("{")]


@pytest.mark.parametrize(
    ("argv", "flag", "why"),
    [
        (["--max-model-len", "999999"], "--max-model-len", "exceeds the model's"),
        (["--tensor-parallel-size", "3"], "--tensor-parallel-size", "must divide the model's num_heads"),
        (["--device", "cuda:64"], "--device", "cuda:64"),
        (["--port", "99999"], "--port", "port must be a TCP port (1-65535), got 99999"),
        (["--port", "HELD"], "--port", "is already in use"),
    ],
)
def test_serve_stops_a_bad_setting_with_one_line_and_status_2(
    tiny_model_dir: Path, held_port: int, argv: list[str], flag: str, why: str
) -> None:
    argv = [str(held_port) if a == "HELD" else a for a in argv]
    code, lines = _run(["pagedserve", "serve", str(tiny_model_dir), *argv])
    assert code == 2, lines
    assert lines[0] == "usage: pagedserve serve MODEL [flags]" and len(lines) == 2, lines
    assert lines[1].startswith(f"pagedserve serve: error: {flag}: ") and why in lines[1], lines


def test_serve_refuses_a_model_family_it_does_not_run(gpt2_dir: Path) -> None:
    code, lines = _run(["pagedserve", "serve", str(gpt2_dir)])
    assert code == 2 and len(lines) == 2, lines
    assert lines[1].startswith("pagedserve serve: error: --model: unsupported model_type 'gpt2'"), lines


def test_each_process_stops_a_bad_setting_with_one_line_and_status_2(
    tiny_model_dir: Path, held_port: int
) -> None:
    held, model = f"tcp://127.0.0.1:{held_port}", str(tiny_model_dir)
    for argv, line in [
        (["worker", "--model", model, "--max-model-len", "99999"], "worker: error: --max-model-len: "),
        (["api", "--port", str(held_port)], "api: error: --port: cannot listen on 127.0.0.1:"),
        (["api", "--port", "70000"], "error: --port: bad setting: port must be a TCP port"),
        (["scheduler", "--scheduler-address", held], "scheduler: error: --scheduler-address: 127.0.0.1:"),
        (["scheduler", "--worker-address", "udp://x:1"], "scheduler: error: --worker-address: 'udp://x:1'"),
    ]:  # fmt: skip
        code, lines = _run(argv)
        assert code == 2 and len(lines) == 1 and lines[0].startswith(line), (argv, lines)


def test_worker_checks_name_the_flag(tiny_model_dir: Path, gpt2_dir: Path) -> None:
    from pagedserve.worker.preflight import check_worker_config

    model = str(tiny_model_dir)
    assert check_worker_config(WorkerConfig(model=model, device="cpu", tensor_parallel_size=2)).num_heads == 4
    for config, flag in [
        (WorkerConfig(model=model, max_model_len=1 << 20), "--max-model-len"),
        (WorkerConfig(model=model, tensor_parallel_size=3), "--tensor-parallel-size"),
        (WorkerConfig(model=model, device="gpu"), "--device"),
        (WorkerConfig(model=model, device="cpu:1"), "--device"),
        (WorkerConfig(model=str(gpt2_dir)), "--model"),
        (WorkerConfig(model=model, worker_address="localhost:5571"), "--worker-address"),
    ]:
        with pytest.raises(ConfigError) as raised:
            check_worker_config(config)
        assert raised.value.flag == flag and str(raised.value).startswith(flag + ": ")


def test_a_config_refusal_names_the_flag_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        parse_config(WorkerConfig, ["--grammar-threads", "1000"])
    assert done.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --grammar-threads: bad setting: grammar_threads must be within [0, 64], got 1000"
    )
    names = ["port", "model", "max_model_len"]
    assert flag_named_in("port must be a TCP port", names) == "--port"
    assert flag_named_in("the model's max_model_len is 5", names) == "--max-model-len"  # "model": a word
    assert flag_named_in("nothing here", names) == ""


def test_ports_and_addresses_are_checked_in_range_and_free(held_port: int, tmp_path: Path) -> None:
    check_port("127.0.0.1", _free())  # a free port passes
    check_bind_address(f"ipc://{tmp_path}/scheduler.sock", "--scheduler-address")
    for call, flag in [
        (lambda: check_port("127.0.0.1", 65536), "--port"),
        (lambda: check_port("127.0.0.1", held_port), "--port"),
        (lambda: check_port("no-such-host.invalid", 8000), "--host"),
        (lambda: check_bind_address(f"tcp://127.0.0.1:{held_port}", "--worker-address"), "--worker-address"),
        (lambda: check_bind_address("tcp://127.0.0.1", "--worker-address"), "--worker-address"),
        (lambda: check_bind_address(f"ipc://{tmp_path}/none/s.sock", "--worker-address"), "--worker-address"),
    ]:
        with pytest.raises(ConfigError) as raised:
            call()
        assert raised.value.flag == flag


def _free() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
