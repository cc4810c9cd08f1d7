"""Tensor parallelism on two GPUs: NCCL between the ranks, the Triton kernels, CUDA graphs for decode steps
(with the all-reduces captured in them). The same plans and checks as the CPU test over gloo
(test_tensor_parallel.py). Skipped without two CUDA devices; run on the device machine with
`pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.test_tensor_parallel import (
    CHECKPOINTS,
    WORLD_SIZE,
    _run_ranks,
    check_two_ranks_match_one_process,
    checkpoints,  # noqa: F401 (a fixture)
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < WORLD_SIZE, reason=f"needs {WORLD_SIZE} CUDA devices"),
]


@pytest.fixture(scope="module")
def gpu_tensor_parallel_runs(
    checkpoints: dict[str, Path],  # noqa: F811
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, list[dict[str, Any]]]:
    out_dir = tmp_path_factory.mktemp("tensor-parallel-gpu")
    _run_ranks(checkpoints, out_dir, device="cuda")
    return {
        name: [torch.load(out_dir / f"{name}-rank{rank}.pt") for rank in range(WORLD_SIZE)]
        for name in checkpoints
    }


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_two_gpus_match_one_gpu(name: str, checkpoints, gpu_tensor_parallel_runs) -> None:  # noqa: F811
    check_two_ranks_match_one_process(checkpoints[name], gpu_tensor_parallel_runs[name], "cuda")
