"""Fixtures for the api tests: the app in front of a fake scheduler, and the tiny checkpoint's tokenizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagedserve.common.config import ApiConfig
from tests.api.harness import ApiServer


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[ApiServer]:
    """Shared by a module's tests: leave the fake scheduler's settings as you found them."""
    api = ApiServer(str(tiny_model_dir))
    yield api
    api.close()


@pytest.fixture
def make_server(tiny_model_dir: Path) -> Iterator[Any]:
    """Builds servers with fake-scheduler options of their own, closed after the test."""
    made: list[ApiServer] = []

    def make(config: ApiConfig | None = None, send_buffer: int = 0, **fake_options: Any) -> ApiServer:
        made.append(ApiServer(str(tiny_model_dir), config, send_buffer, **fake_options))
        return made[-1]

    yield make
    for api in made:
        api.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))
