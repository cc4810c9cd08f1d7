"""Fixtures shared by the whole test suite."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from scripts.make_model import make_model

FOLDERS = ("api", "client", "common", "kernels", "scheduler", "worker")


@pytest.fixture(scope="session", autouse=True)
def _one_copy_of_each_module() -> Iterator[None]:
    """The server's packages are imported as pagedserve.NAME only: a test that reached one by its folder's
    name (`monkeypatch.setattr("api.auth.X", ...)` imports the checkout's api/ as a second, unused copy) would
    patch or check a module that nothing runs. (A bare package may be found by name: transformers looks for
    a Hugging Face package called `kernels` and finds the checkout's folder; only its modules would copy.)"""
    yield
    root = Path(__file__).resolve().parents[1]
    stray = sorted(
        name
        for name, module in list(sys.modules.items())
        if "." in name
        and name.split(".")[0] in FOLDERS
        and str(getattr(module, "__file__", "") or "").startswith(str(root))
    )
    assert stray == [], f"imported by their folder's name instead of through pagedserve: {stray[:10]}"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama checkpoint with its tokenizer, built once per test session."""
    return make_model(tmp_path_factory.mktemp("models") / "tiny-llama", preset="tiny", seed=0)
