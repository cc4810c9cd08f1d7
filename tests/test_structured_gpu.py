"""Structured output on a GPU: the bitmasks applied to CUDA logits (bfloat16, CUDA graphs, pipelined steps,
preemption), every output validated with `jsonschema`. Skipped without CUDA; run with `pytest -m gpu`."""

from __future__ import annotations

import pytest
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.worker.model_runner import ModelRunner
from tests.test_structured_output import _assert_valid, _prompts, _run, _schema_params

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


@pytest.mark.parametrize("order", ["worker", False], ids=["worker-order", "sync"])
def test_the_launch_trace_splits_the_gpu_time_at_the_sampler(tiny_model_dir, order):
    """With the step trace on, each sampled step's GPU time splits into its forward, the GPU's wait for the
    sampler's launch and the sampler (worker/launch_trace.py), which add up to the step's GPU time; the
    masks' host costs come with them; the outputs stay valid (the one-step order fills masks ahead)."""
    config = WorkerConfig(
        model=str(tiny_model_dir), device="cuda", dtype="bfloat16", block_size=4, num_kv_blocks=400
    )
    runner = ModelRunner(config, attention_backend="triton")
    runner.trace_launches = True
    finish = runner.finish
    splits = []

    def traced_finish():
        out = finish()
        split = runner.launch_trace.take(out.step_id)
        if out.seq_ids:
            splits.append((out.gpu_time_s * 1e3, split))
        return out

    runner.finish = traced_finish
    schemas, params = _schema_params(seed=12, num=16)
    outputs, _ = _run(runner, _prompts(16, 8), params, order, max_num_seqs=16, max_num_batched_tokens=256)
    _assert_valid(runner, outputs, schemas, tiny_model_dir)
    assert len(splits) > 20
    for gpu_ms, split in splits:
        parts = [split["forward_gpu_ms"], split["sampler_wait_gpu_ms"], split["sampler_gpu_ms"]]
        assert min(parts) >= 0 and sum(parts) == pytest.approx(gpu_ms, abs=0.05)
        assert split["structured_rows"] > 0
    assert sum(split["structured_reused_rows"] > 0 for _, split in splits) > 10
