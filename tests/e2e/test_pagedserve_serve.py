"""The installed form: the project built and installed into a fresh virtual environment, as `pip install .`
does, then `pagedserve` run from there (away from the checkout, so nothing is imported from it).

The environment reuses this one's packages (torch, transformers, ...) through a .pth file, since nothing can
be downloaded; this one is itself a venv, so `--system-site-packages` would give the bare base interpreter's.
The .pth comes after the new environment's own site-packages: what pip installs there wins.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import site
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
SOURCES = ["pyproject.toml", "setup.py", "README.md", "pagedserve", "api", "client", "common", "kernels",
           "scheduler", "worker"]  # fmt: skip
FOLDERS = ["api", "client", "common", "kernels", "scheduler", "worker"]


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with pagedserve installed by pip from a copy of the sources (the build writes there)."""
    base = tmp_path_factory.mktemp("installed")
    src = base / "src"
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            src.mkdir(exist_ok=True)
            shutil.copy(path, src / name)
    env_dir = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=60)
    python = env_dir / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    (Path(purelib) / "shared_env.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index", str(src)],
        check=True, cwd=base, timeout=180,
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
    """`kernels` (a Hugging Face package transformers looks for), `common`, `worker`, ... stay free in the
    environment; only a process that imports pagedserve sees the server's packages by those names."""
    probe = (
        "import importlib.util, json, sys\n"
        f"names = {FOLDERS!r}\n"
        "before = {n: getattr(importlib.util.find_spec(n), 'origin', None) for n in names}\n"
        "import pagedserve, kernels, worker.server\n"
        "print(json.dumps({'before': before, 'root': str(pagedserve.CODE_ROOT),\n"
        "                  'kernels': kernels.__file__, 'worker': worker.server.__file__}))\n"
    )
    done = run(venv, "python", "-c", probe, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    for name, origin in found["before"].items():
        assert origin is None or not (origin.startswith(str(venv)) or origin.startswith(str(ROOT))), name
    root = Path(found["root"])
    assert root.name == "pagedserve" and root.is_relative_to(venv)  # site-packages/pagedserve
    assert Path(found["kernels"]).is_relative_to(root) and Path(found["worker"]).is_relative_to(root)
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


def log_event(text: str, event: str) -> dict:
    """The first JSON log line of `event` in `text`."""
    return next(
        e for line in text.splitlines() if line.startswith("{") and (e := json.loads(line))["event"] == event
    )


@pytest.fixture
def hf_home(tmp_path: Path, tiny_model_dir: Path) -> Iterator[Path]:
    home = tmp_path / "hf"
    add_to_hub_cache(home, "org/tiny-llama", tiny_model_dir)
    yield home


@pytest.mark.e2e
def test_pagedserve_serve_a_repo_id_from_the_cache_and_stop_on_sigterm(
    venv: Path, hf_home: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Offline, with the model only in a hub cache: the installed command serves greedy completions equal to
    transformers' own, logs where the memory went, and SIGTERM stops every process with status 0."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PAGEDSERVE_", "HF_"))}
    env |= {"HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1"}
    argv = [
        str(venv / "bin" / "pagedserve"), "serve", "org/tiny-llama", "--port", str(port), "--device", "cpu",
        "--scheduler-address", f"tcp://127.0.0.1:{free_port()}",
        "--worker-address", f"tcp://127.0.0.1:{free_port()}",
        "--cluster-key-file", str(tmp_path / "cluster_key"), "--num-kv-blocks", "24",
        "--shutdown-timeout-s", "3",
    ]  # fmt: skip
    log_path = tmp_path / "pagedserve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    supervisors: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while health(url) != 200:
            assert proc.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.3)
        supervisors = list(log_event(log_path.read_text(), "serving")["supervisors"].values())
        prompt = [1, 15, 27, 300, 42]
        body = post(url + "/v1/completions", {"model": "org/tiny-llama", "prompt": prompt, "max_tokens": 6,
                                              "temperature": 0, "ignore_eos": True})  # fmt: skip
        assert body["model"] == "org/tiny-llama" and body["usage"]["completion_tokens"] == 6
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, min_new_tokens=6)
        expected = AutoTokenizer.from_pretrained(tiny_model_dir).decode(out[0, len(prompt) :])
        assert body["choices"][0]["text"] == expected
        memory = log_event(log_path.read_text(), "memory")
        assert memory["kv_blocks"] == 24 and memory["kv_tokens"] == 24 * 16 and memory["weights_gib"] > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, log_path.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in supervisors:  # their own sessions: whatever is left of them
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    children = [e["pid"] for e in lines if e.get("process") == "supervisor" and e["event"] == "started"]
    assert len(children) == 3, children  # api, scheduler, worker: each started once, none restarted
    for pid in [*supervisors, *children]:  # nothing keeps running
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
