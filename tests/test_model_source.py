"""common/model_source.py: a --model is a local directory, or a Hugging Face repo id found in a hub cache
laid out here (offline: nothing can be downloaded), and every process resolves it the same way."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest

from pagedserve.common.config import ApiConfig, WorkerConfig, parse_config
from pagedserve.common.model_source import ModelSourceError, is_repo_id, resolve_config, resolve_model
from tests.hub_cache import add_to_hub_cache

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hf_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> Path:
    """A hub cache holding the tiny model as org/tiny at COMMIT (refs main and v1), offline. The Hub reads
    its variables when imported: its constants are patched too, for this process."""
    home = tmp_path / "hf"
    add_to_hub_cache(home, "org/tiny", tiny_model_dir, COMMIT, refs=("main", "v1"))
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return home


def test_a_local_directory_is_itself(tiny_model_dir: Path) -> None:
    source = resolve_model(str(tiny_model_dir))
    assert source.path == str(tiny_model_dir) and source.name == tiny_model_dir.name and not source.repo_id


def test_a_revision_with_a_local_directory_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ModelSourceError, match="is for a Hugging Face repo id"):
        resolve_model(str(tiny_model_dir), "main")


def test_a_directory_without_config_is_refused_when_strict(tmp_path: Path) -> None:
    with pytest.raises(ModelSourceError, match="has no config.json"):
        resolve_model(str(tmp_path))
    assert resolve_model(str(tmp_path), strict=False).path == str(tmp_path)


def test_a_path_that_is_no_repo_id_passes_through_unless_strict(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelSourceError, match="no such directory, and not a Hugging Face repo id"):
        resolve_model(missing)
    # the api then stays up and says "misconfigured" on /health, as it always has
    assert resolve_model(missing, strict=False).path == missing


@pytest.mark.parametrize(
    ("text", "expected"),
    [("org/name", True), ("name", True), ("Org-1/na.me_2", True), ("/abs/path", False), ("./x", False),
     ("a/b/c", False), ("org/../x", False), ("", False)],
)  # fmt: skip
def test_repo_id_form(text: str, expected: bool) -> None:
    assert is_repo_id(text) is expected


@pytest.mark.parametrize("revision", ["", "main", "v1", COMMIT])
def test_a_cached_repo_id_resolves_offline_to_its_snapshot(hf_home: Path, revision: str) -> None:
    source = resolve_model("org/tiny", revision)
    snapshot = hf_home / "hub" / "models--org--tiny" / "snapshots" / COMMIT
    assert Path(source.path) == snapshot and (snapshot / "config.json").is_file()
    assert source.name == source.repo_id == "org/tiny" and source.revision == COMMIT


def test_an_uncached_repo_id_offline_is_one_clear_line(hf_home: Path) -> None:
    with pytest.raises(ModelSourceError) as raised:
        resolve_model("org/other")
    message = str(raised.value)
    assert "\n" not in message and "org/other" in message and "HF_HUB_OFFLINE" in message
    with pytest.raises(ModelSourceError, match="'org/tiny' at revision 'v2'"):
        resolve_model("org/tiny", "v2")  # an unknown ref of a cached repo


def test_resolve_config_serves_a_hub_model_under_its_repo_id(hf_home: Path) -> None:
    worker = resolve_config(WorkerConfig(model="org/tiny", revision="v1"))
    assert Path(worker.model).name == COMMIT and worker.revision == ""
    assert worker.served_model_name == "org/tiny"
    named = resolve_config(ApiConfig(model="org/tiny", served_model_name="mine"))
    assert named.served_model_name == "mine" and Path(named.model).name == COMMIT
    assert resolve_config(ApiConfig()) == ApiConfig()  # no --model: learnt from the worker, untouched


def test_parse_config_resolves_the_model_of_the_api_and_the_worker(hf_home: Path) -> None:
    for cls in (ApiConfig, WorkerConfig):
        config = parse_config(cls, ["--model", "org/tiny"])
        assert Path(config.model).parent.name == "snapshots" and config.served_model_name == "org/tiny"


def test_a_process_given_an_uncached_repo_id_exits_2_with_one_line(tmp_path: Path) -> None:
    """In a real process, with the Hub's variables read from the environment: exit status 2, which the
    supervisor does not restart, and one line on stderr, no traceback."""
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    code = (
        "from common.config import ApiConfig, parse_config; parse_config(ApiConfig, ['--model', 'org/none'])"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"error: --model: model 'org/none': no such directory, not in the Hugging Face cache "
        f"({tmp_path}/hf/hub), and HF_HUB_OFFLINE is set"
    ]
