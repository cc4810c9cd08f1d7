from __future__ import annotations

import pytest

from tests.e2e.processes import start_server


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    """One server per test module: small pool (64 blocks of 16) so concurrent load preempts."""
    srv = start_server(
        tiny_model_dir,
        tmp_path_factory.mktemp("logs"),
        num_kv_blocks=64,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        max_model_len=512,
    )
    yield srv
    srv.stop()
