"""Structured output on a GPU: the bitmasks applied to CUDA logits (bfloat16, CUDA graphs, pipelined steps,
preemption), every output validated with `jsonschema`. Skipped without CUDA; run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from common.config import WorkerConfig
from tests.test_structured_output import _assert_valid, _prompts, _run, _schema_params
from worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("order", [True, "worker"], ids=["launch", "worker-order"])  # (_run's `pipelined`)
@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_random_schemas_give_valid_json_on_the_gpu(tiny_model_dir, preemption_mode, dtype, order):
    config = WorkerConfig(
        model=str(tiny_model_dir), device="cuda", dtype=dtype, block_size=4, num_kv_blocks=66, swap_space=0.05
    )
    runner = ModelRunner(config, attention_backend="triton")
    schemas, params = _schema_params(seed=11, num=24, n=2, max_tokens=100)
    outputs, scheduler = _run(
        runner, _prompts(24, 7), params, pipelined=order, max_num_seqs=32, max_num_batched_tokens=256,
        preemption_mode=preemption_mode,
    )  # fmt: skip
    assert scheduler.metrics.preemptions_total > 0
    _assert_valid(runner, outputs, schemas, tiny_model_dir, n=2)
