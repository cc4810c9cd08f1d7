"""pagedserve/cli.py and pagedserve/launcher.py: `pagedserve serve`'s flags are the processes' own, routed to
the processes whose config has them, checked before anything starts; the launcher supervises and stops the
processes together. (tests/e2e/test_pagedserve_serve.py runs the installed command for real.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from pagedserve.cli import NOT_FLAGS, PROCESSES, build_parser, main, owners, serve_children
from pagedserve.common.config import (
    ApiConfig,
    SchedulerConfig,
    WorkerConfig,
    choices_of,
    field_descriptions,
    parse_config,
)
from pagedserve.replicas.config import ReplicasConfig
from scripts.make_model import make_model

ROOT = Path(__file__).resolve().parents[1]


def test_serve_help_shows_every_flag_with_its_description_default_and_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as done:
        build_parser().parse_args(["serve", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for name, cls in PROCESSES:
        descriptions = field_descriptions(cls)
        for f in fields(cls):
            if f.name in NOT_FLAGS:
                continue
            flag = "--" + f.name.replace("_", "-")
            assert flag in text, flag
            assert f"env PAGEDSERVE_{f.name.upper()}" in text
            if descriptions.get(f.name) and owners()[f.name][0] == name:  # a shared flag: its first owner's
                assert " ".join(descriptions[f.name].split()) in text, f.name
        for values in choices_of(cls).values():
            assert "{" + ",".join(values) + "}" in text
    assert "used by api, scheduler, worker" in text  # e.g. --shutdown-timeout-s
    assert "A local checkpoint directory, or a Hugging Face repo id" in text  # MODEL


def test_every_field_of_every_process_has_a_description() -> None:
    """`--help` of `pagedserve serve` and of each `python -m PROCESS` says what every flag does."""
    for _, cls in PROCESSES:
        assert [f.name for f in fields(cls) if not field_descriptions(cls).get(f.name)] == [], cls.__name__


def test_every_flag_appears_once() -> None:
    parser = build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    flags = [s for a in serve._actions for s in a.option_strings if s.startswith("--")]
    assert len(flags) == len(set(flags))
    expected = {n for n in owners() if n not in NOT_FLAGS} | {f.name for f in fields(ReplicasConfig)}
    named = {f.removeprefix("--").removeprefix("no-").replace("-", "_") for f in flags} - {"help"}
    assert named == expected


def test_fields_that_processes_share_have_one_default() -> None:
    """One flag sets a shared field for every process that has it: their defaults must agree, or routing
    the flag's default would change a process's behaviour (the model is MODEL, not a flag)."""
    for name, procs in owners().items():
        if len(procs) < 2 or name == "model":
            continue
        defaults = {
            f.default
            for _, cls in PROCESSES
            for f in fields(cls)
            if f.name == name and f.default is not MISSING
        }
        assert len(defaults) == 1, (name, defaults)


def parse(argv: list[str]) -> tuple[list, dict[str, str]]:
    parser = build_parser()
    args = parser.parse_args(["serve", *argv])
    return serve_children(args, args.command_parser)


def test_values_reach_every_process_whose_config_has_them(tiny_model_dir: Path) -> None:
    children, env = parse(
        [str(tiny_model_dir), "--port", "9001", "--max-num-seqs", "7", "--no-enable-prefix-caching",
         "--dtype", "float32", "--api-key", "k"]
    )  # fmt: skip
    assert [(c.name, c.module) for c in children] == [
        ("api", "pagedserve.api"), ("scheduler", "pagedserve.scheduler"), ("worker", "pagedserve.worker")
    ]  # fmt: skip
    assert env["PAGEDSERVE_MODEL"] == str(tiny_model_dir) and env["PAGEDSERVE_REVISION"] == ""
    assert env["PAGEDSERVE_PORT"] == "9001" and env["PAGEDSERVE_MAX_NUM_SEQS"] == "7"
    assert env["PAGEDSERVE_ENABLE_PREFIX_CACHING"] == "false" and env["PAGEDSERVE_DTYPE"] == "float32"
    assert "PAGEDSERVE_FUSED_OPS" not in env  # unset (None): each process's own default
    assert "PAGEDSERVE_RANK" not in env
    # each process parses exactly what it is given back into the values given here
    for cls in (ApiConfig, SchedulerConfig, WorkerConfig):
        saved = dict(os.environ)
        try:
            os.environ.update(env)
            config = parse_config(cls, [])
        finally:
            os.environ.clear()
            os.environ.update(saved)
        for field_name, value in (("port", 9001), ("max_num_seqs", 7), ("enable_prefix_caching", False)):
            if hasattr(config, field_name):
                assert getattr(config, field_name) == value


def test_load_format_dummy_and_its_seed_reach_the_worker(tmp_path: Path) -> None:
    """A directory without weights (scripts/make_model.py --no-weights) is served with random ones."""
    model_dir = make_model(tmp_path / "config-only", preset="tiny", weights=False)
    _, env = parse([str(model_dir), "--load-format", "dummy", "--seed", "5"])
    assert env["PAGEDSERVE_LOAD_FORMAT"] == "dummy" and env["PAGEDSERVE_SEED"] == "5"
    assert parse_config(WorkerConfig, ["--model", str(model_dir)]).load_format == "auto"  # the default


def test_tensor_parallel_size_starts_one_worker_per_rank_meeting_at_a_free_port(tiny_model_dir: Path) -> None:
    children, env = parse([str(tiny_model_dir), "--tensor-parallel-size", "3"])
    workers = [c for c in children if c.module == "pagedserve.worker"]
    assert [c.name for c in workers] == ["worker", "worker1", "worker2"]
    assert [c.env["PAGEDSERVE_RANK"] for c in workers] == ["0", "1", "2"]
    assert [c.after for c in workers] == ["", "worker", "worker"]  # rank 0 stops the others first
    assert env["PAGEDSERVE_DIST_INIT_METHOD"] != WorkerConfig.dist_init_method
    _, env = parse([str(tiny_model_dir), "--tensor-parallel-size", "2", "--dist-init-method", "tcp://h:1"])
    assert env["PAGEDSERVE_DIST_INIT_METHOD"] == "tcp://h:1"  # a chosen rendezvous is kept


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--dtype", "float8"], "argument --dtype: invalid choice: 'float8'"),
        (["--port", "eighty"], "argument --port: invalid int value: 'eighty'"),
        (["--preemption-mode", "never"], "argument --preemption-mode: invalid choice"),
        (["--max-waiting-seqs", "0"], "bad setting: max_waiting_seqs must be at least 1"),
        (["--revision", "v1"], "is for a Hugging Face repo id"),
        (["--load-format", "pt"], "argument --load-format: invalid choice: 'pt'"),
    ],
)
def test_bad_values_fail_before_anything_starts_with_one_line(
    tiny_model_dir: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as done:
        main(["serve", str(tiny_model_dir), *argv])
    assert done.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0] == "usage: pagedserve serve MODEL [flags]" and len(lines) == 2
    assert message in lines[1], lines


def test_a_bad_environment_variable_is_one_line_and_status_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PAGEDSERVE_PORT", "http")
    assert main(["serve", "x"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "pagedserve: error: PAGEDSERVE_PORT='http': invalid literal for int() with base 10: 'http'"
    ]


def test_an_environment_variable_is_a_default_and_a_flag_wins(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PAGEDSERVE_MODEL", str(tiny_model_dir))
    monkeypatch.setenv("PAGEDSERVE_NUM_KV_BLOCKS", "33")
    monkeypatch.setenv("PAGEDSERVE_PORT", "9002")
    _, env = parse(["--port", "9003"])  # MODEL from PAGEDSERVE_MODEL
    assert env["PAGEDSERVE_MODEL"] == str(tiny_model_dir)
    assert env["PAGEDSERVE_NUM_KV_BLOCKS"] == "33" and env["PAGEDSERVE_PORT"] == "9003"


# The launcher, with stand-in processes (`python -m pagedserve.common.supervisor fake_api` runs
# `python -m fake_api`)
FAKE = """
import os, signal, sys, time
name = {name!r}
with open(os.environ["FAKE_DIR"] + "/" + name + "." + os.environ.get("PAGEDSERVE_RANK", "0"), "w") as f:
    f.write(os.environ.get("PAGEDSERVE_MAX_NUM_SEQS", ""))
if name == os.environ.get("FAKE_FAIL"):
    sys.exit(2)
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
signal.signal(signal.SIGINT, lambda *a: sys.exit(0))
while True:
    time.sleep(0.05)
"""

RUN = """
import sys
from pagedserve.launcher import Child, Launcher
rank1 = {"PAGEDSERVE_RANK": "1"}
children = [Child("api", "fake_api"), Child("worker", "fake_worker"), Child("worker1", "fake_worker", rank1)]
sys.exit(Launcher(children, {"PAGEDSERVE_MAX_NUM_SEQS": "5"}, stop_timeout_s=0.0).run())
"""


@pytest.fixture
def start_launcher(tmp_path: Path) -> Iterator[Callable[[str], subprocess.Popen[str]]]:
    """Starts a launcher of stand-ins in a process; kills what is left of it at the end."""
    started: list[subprocess.Popen[str]] = []
    yield lambda fail="": started.append(_start_launcher(tmp_path, fail)) or started[-1]
    for proc in started:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start_launcher(tmp_path: Path, fail: str = "") -> subprocess.Popen[str]:
    fakes = tmp_path / "fakes"
    for name in ("api", "worker"):
        (fakes / f"fake_{name}").mkdir(parents=True)
        (fakes / f"fake_{name}" / "__init__.py").write_text("")
        (fakes / f"fake_{name}" / "__main__.py").write_text(textwrap.dedent(FAKE.format(name=name)))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{fakes}", FAKE_DIR=str(tmp_path), FAKE_FAIL=fail)
    return subprocess.Popen(
        [sys.executable, "-c", RUN], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True
    )


def wait_for(check, timeout: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_stops_every_process_and_exits_0(
    tmp_path: Path, start_launcher: Callable[..., subprocess.Popen[str]], signum: int
) -> None:
    launcher = start_launcher()
    started = [tmp_path / "api.0", tmp_path / "worker.0", tmp_path / "worker.1"]
    wait_for(lambda: all(p.exists() for p in started))
    # the settings reached every process; the cwd's folders would not shadow the server's (PYTHONSAFEPATH)
    assert all(p.read_text() == "5" for p in started)
    launcher.send_signal(signum)
    assert launcher.wait(30) == 0, launcher.stderr.read()  # type: ignore[union-attr]
    log = launcher.stderr.read()  # type: ignore[union-attr]
    assert '"event": "stopped"' in log and '"api": 0' in log


def test_a_usage_error_in_one_process_stops_the_others_with_its_status(
    start_launcher: Callable[..., subprocess.Popen[str]],
) -> None:
    launcher = start_launcher("worker")
    assert launcher.wait(30) == 2  # the worker's status 2 is not restarted, and stops the api too
    log = launcher.stderr.read()  # type: ignore[union-attr]
    assert '"event": "not_restarted"' in log and '"event": "process_exited"' in log
    assert '"event": "stopped"' in log
