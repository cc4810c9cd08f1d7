"""Fixtures shared by the whole test suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.make_model import make_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama checkpoint with its tokenizer, built once per test session."""
    return make_model(tmp_path_factory.mktemp("models") / "tiny-llama", preset="tiny", seed=0)
