"""Speculative verification under tensor parallelism on two GPUs: NCCL between the ranks, the Triton
kernels, CUDA graphs for the target's decode and verification rows and the draft model's own graphs on each
rank. The same configs and checks as the CPU test over gloo (test_verify_tensor_parallel.py), against one
GPU without speculation. Skipped without two CUDA devices; run on the device machine with `pytest -m gpu`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.test_tensor_parallel import ON_GPUS
from tests.test_verify_tensor_parallel import (
    SPEC_NAMES,
    check_ranks_verify_as_one_process,
    greedy_without_speculation,
    run_ranks,
)

pytestmark = ON_GPUS


@pytest.fixture(scope="module")
def gpu_ranks(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict[str, Any]]]:
    return run_ranks(tiny_model_dir, tmp_path_factory.mktemp("tp-spec-gpu"), device="cuda")


@pytest.fixture(scope="module")
def gpu_single(tiny_model_dir: Path) -> dict[tuple[int, int], list[int]]:
    return greedy_without_speculation(tiny_model_dir, "cuda")


@pytest.mark.parametrize("name", SPEC_NAMES)
def test_two_gpus_verify_as_one_gpu_without_speculation(name, gpu_ranks, gpu_single) -> None:
    check_ranks_verify_as_one_process(name, gpu_ranks[name], gpu_single)
