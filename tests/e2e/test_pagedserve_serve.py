"""The installed form, as a user gets it: a wheel built from the sources, installed with its dependencies into
a fresh virtual environment (`pip install -c constraints.txt WHEEL`, torch from the pinned CPU build), then
`pagedserve` run from there, away from the checkout, so nothing is imported from it. A runtime import missing
from pyproject's dependencies fails here as it would for a user.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts._servers import free_port
from tests.hub_cache import add_to_hub_cache

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["pyproject.toml", "setup.py", "README.md", "LICENSE", "constraints.txt", "pagedserve", "api",
           "client", "common", "kernels", "scheduler", "worker"]  # fmt: skip
FOLDERS = ["api", "client", "common", "kernels", "scheduler", "worker"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv holding the wheel built from a copy of the sources and every dependency it declares, at
    constraints.txt's versions (pip's cache and the machine's wheel folder make this a local install)."""
    base = tmp_path_factory.mktemp("installed")
    src = base / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", base / "dist",
         src],
        check=True, cwd=base, timeout=300,
    )  # fmt: skip
    [wheel] = (base / "dist").glob("pagedserve-*.whl")
    env_dir = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True, timeout=120)
    subprocess.run(
        [env_dir / "bin" / "python", "-m", "pip", "install", "-q", "-c", src / "constraints.txt", wheel],
        check=True, cwd=base, timeout=900,
    )  # fmt: skip
    return env_dir


def run(venv: Path, *argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / argv[0]), *argv[1:]], cwd=cwd, capture_output=True, text=True, timeout=60
    )


def test_the_installed_command_answers_help(venv: Path, tmp_path: Path) -> None:
    top = run(venv, "pagedserve", "--help", cwd=tmp_path)
    assert top.returncode == 0 and "serve" in top.stdout, top.stderr
    serve = run(venv, "pagedserve", "serve", "--help", cwd=tmp_path)
    text = " ".join(serve.stdout.split())
    assert serve.returncode == 0, serve.stderr
    assert (
        "--tensor-parallel-size" in text and "A local checkpoint directory, or a Hugging Face repo id" in text
    )
    assert "{auto,float32,bfloat16,float16}" in text  # --dtype's choices
    same = run(venv, "python", "-m", "pagedserve", "serve", "--help", cwd=tmp_path)
    assert same.returncode == 0 and same.stdout == serve.stdout


def test_the_install_takes_no_generic_top_level_names(venv: Path, tmp_path: Path) -> None:
    """Only `pagedserve` is a top-level name of the install: a user's own `common`, `client` and `api` modules
    (and Hugging Face's `kernels`) stay theirs, beside the server's packages imported through pagedserve."""
    for name in ("common", "client", "api"):
        (tmp_path / f"{name}.py").write_text(f"MINE = {name!r}\n")
    probe = (
        "import importlib.util, json, sys\n"
        f"names = {FOLDERS!r}\n"
        "before = {n: getattr(importlib.util.find_spec(n), 'origin', None) for n in names}\n"
        "import pagedserve, pagedserve.worker.server\n"
        "from pagedserve.client import EngineClient\n"
        "import common, client, api\n"
        "print(json.dumps({'before': before, 'root': str(pagedserve.CODE_ROOT),\n"
        "                  'worker': pagedserve.worker.server.__file__,\n"
        "                  'mine': [common.MINE, client.MINE, api.MINE],\n"
        "                  'top': sorted(n for n in names if n in sys.modules and\n"
        "                                not getattr(sys.modules[n], 'MINE', None))}))\n"
    )
    done = run(venv, "python", "-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for name, origin in found["before"].items():
        assert origin is None or not (origin.startswith(str(venv)) or origin.startswith(str(ROOT))), name
    root = Path(found["root"])
    assert root.name == "pagedserve" and root.is_relative_to(venv)  # site-packages/pagedserve
    assert Path(found["worker"]).is_relative_to(root)
    assert found["mine"] == ["common", "client", "api"] and found["top"] == []
    purelib = root.parent
    assert not any((purelib / name).exists() for name in FOLDERS)


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def health(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0


def log_events(text: str) -> Iterator[dict]:
    """The JSON log lines in `text`. The processes share one stdout and print writes the newline apart, so
    two objects may share a line: each is decoded where it starts."""
    decoder = json.JSONDecoder()
    for line in text.splitlines():
        at = line.find("{")
        while at != -1:
            try:
                event, end = decoder.raw_decode(line, at)
            except json.JSONDecodeError:
                break
            if isinstance(event, dict):
                yield event
            at = line.find("{", end)


def log_event(text: str, event: str) -> dict:
    """The first JSON log line of `event` in `text`."""
    return next(e for e in log_events(text) if e.get("event") == event)


@pytest.fixture
def hf_home(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Path]:
    home = tmp_path / "hf"
    add_to_hub_cache(home, "org/tiny-llama", tiny_model_dir)
    yield home


class Served:
    """`pagedserve serve ARGS` of `venv`, run from `tmp_path` on free 127.0.0.1 ports, logging to a file."""

    def __init__(
        self, venv: Path, tmp_path: Path, args: list[str], env: dict[str, str] | None = None
    ) -> None:
        self.url = f"http://127.0.0.1:{free_port()}"
        self.scheduler_address = f"tcp://127.0.0.1:{free_port()}"
        self.log_path = tmp_path / "pagedserve.log"
        base = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDSERVE_", "HF_"))}
        argv = [
            str(venv / "bin" / "pagedserve"), "serve", *args, "--port", self.url.rsplit(":", 1)[1],
            "--device", "cpu", "--scheduler-address", self.scheduler_address,
            "--worker-address", f"tcp://127.0.0.1:{free_port()}",
            "--cluster-key-file", str(tmp_path / "cluster_key"), "--shutdown-timeout-s", "3",
        ]  # fmt: skip
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, cwd=tmp_path, env=base | (env or {}), stdout=log, stderr=subprocess.STDOUT
            )
        self.supervisors: list[int] = []

    def log(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while health(self.url) != 200:
            assert self.proc.poll() is None, self.log()[-4000:]
            assert time.monotonic() < deadline, self.log()[-4000:]
            time.sleep(0.3)
        self.supervisors = list(log_event(self.log(), "serving")["supervisors"].values())

    def stop(self, once: bool = True) -> int:
        """SIGTERM; returns the exit status. Asserts that every process it started is gone, and with `once`
        that each was started once (a follower rank, told to stop by rank 0 before its own signal comes,
        may be restarted by its supervisor in between, then stopped)."""
        try:
            self.proc.send_signal(signal.SIGTERM)
            code = self.proc.wait(timeout=30)
        finally:
            self.kill()
        events = log_events(self.log())
        children = [e["pid"] for e in events if e.get("process") == "supervisor" and e["event"] == "started"]
        assert len(children) == len(self.supervisors) or not once, self.log()[-3000:]
        for pid in [*self.supervisors, *children]:  # nothing keeps running
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for pid in self.supervisors:  # their own sessions: whatever is left of them
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def greedy_ids(model_dir: Path, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' own greedy continuation of `prompt`, as token ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def greedy(model_dir: Path, prompt: list[int], max_tokens: int) -> str:
    """transformers' own greedy continuation of `prompt`, as text."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir).decode(greedy_ids(model_dir, prompt, max_tokens))


PROMPT = [1, 15, 27, 300, 42]


@pytest.mark.e2e
def test_pagedserve_serve_a_repo_id_from_the_cache_and_stop_on_sigterm(
    venv: Path, hf_home: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Offline, with the model only in a hub cache: the installed command serves greedy completions equal to
    transformers' own, logs where the memory went, and SIGTERM stops every process with status 0."""
    served = Served(venv, tmp_path, ["org/tiny-llama", "--num-kv-blocks", "24"],
                    {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"})  # fmt: skip
    try:
        served.wait_healthy()
        request = {"model": "org/tiny-llama", "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
        body = post(served.url + "/v1/completions", request | {"ignore_eos": True})
        assert body["model"] == "org/tiny-llama" and body["usage"]["completion_tokens"] == 6
        assert body["choices"][0]["text"] == greedy(tiny_model_dir, PROMPT, 6)
        memory = log_event(served.log(), "memory")
        assert memory["kv_blocks"] == 24 and memory["kv_tokens"] == 24 * 16 and memory["weights_gib"] > 0
    except BaseException:
        served.kill()
        raise
    assert served.stop() == 0, served.log()[-4000:]


@pytest.mark.e2e
def test_pagedserve_serve_starts_tensor_parallel_ranks(
    venv: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--tensor-parallel-size 2: two supervised worker ranks (gloo on the CPU) meeting at a free port, serving
    the single process's tokens."""
    served = Served(
        venv, tmp_path, [str(tiny_model_dir), "--tensor-parallel-size", "2", "--num-kv-blocks", "24"]
    )
    try:
        served.wait_healthy()
        assert sorted(log_event(served.log(), "serving")["supervisors"]) == [
            "api",
            "scheduler",
            "worker",
            "worker1",
        ]
        body = post(served.url + "/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                                     "ignore_eos": True})  # fmt: skip
        assert body["model"] == tiny_model_dir.name
        assert body["choices"][0]["text"] == greedy(tiny_model_dir, PROMPT, 6)
    except BaseException:
        served.kill()
        raise
    assert served.stop(once=False) == 0, served.log()[-4000:]  # rank 0 stopped rank 1 first: no error


def readme_example(marker: str) -> str:
    """The code block that follows `<!-- readme-example: MARKER -->` in the README."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index(f"<!-- readme-example: {marker} -->") :]
    return after.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.e2e
def test_the_readme_zeromq_example_runs_against_the_installed_server(
    venv: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The README's direct-submission example, verbatim but for the scheduler's address, run from a folder
    with modules of its own named `client` and `common`: it gets both prompts' greedy tokens."""
    served = Served(venv, tmp_path, [str(tiny_model_dir), "--num-kv-blocks", "24"])
    (tmp_path / "client.py").write_text("raise ImportError('this folder has a client.py of its own')\n")
    (tmp_path / "common.py").write_text("raise ImportError('this folder has a common.py of its own')\n")
    try:
        served.wait_healthy()
        code = readme_example("zeromq").replace("tcp://127.0.0.1:5570", served.scheduler_address)
        code += (
            "assert [len(r.outputs[0].token_ids) for r in results] == [16, 16], results\n"
            "print(results[1].outputs[0].token_ids)\n"
        )
        env = {"PAGEDSERVE_CLUSTER_KEY_FILE": str(tmp_path / "cluster_key"), "PATH": os.environ["PATH"]}
        done = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        expected = greedy_ids(tiny_model_dir, [1, 2, 3], 16)
        assert json.loads(done.stdout.strip().splitlines()[-1]) == expected
    except BaseException:
        served.kill()
        raise
    assert served.stop() == 0, served.log()[-4000:]
