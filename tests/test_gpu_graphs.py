"""CUDA graphs for decode steps against eager execution of the same plans, on a GPU (skipped without CUDA;
run on the device machine with `pytest -m gpu`)."""

from __future__ import annotations

import random

import pytest
import torch

from common.config import WorkerConfig
from common.messages import SamplingParams
from tests.test_engine_correctness import _run_engine
from worker.cuda_graphs import capture_sizes
from worker.model_runner import ModelRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_capture_sizes_cover_every_batch_up_to_max_num_seqs() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(256)[-1] == 256


def _runner(model_dir, enforce_eager: bool, dtype: str) -> ModelRunner:
    cfg = WorkerConfig(
        model=str(model_dir), device="cuda", dtype=dtype, num_kv_blocks=96, max_num_seqs=16,
        enforce_eager=enforce_eager, swap_space=0,
    )  # fmt: skip
    return ModelRunner(cfg, attention_backend="triton")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graph_replay_gives_the_tokens_of_eager_execution(tiny_model_dir, dtype: str) -> None:
    graphs, eager = _runner(tiny_model_dir, False, dtype), _runner(tiny_model_dir, True, dtype)
    assert graphs.graphs is not None and eager.graphs is None
    rng = random.Random(3)
    # 13 prompts of uneven lengths: decode batches of 13 and fewer, padded to the 16 and 8 graphs as they end.
    prompts = [[rng.randrange(graphs.vocab_size) for _ in range(rng.randint(1, 90))] for _ in range(13)]
    params = [
        SamplingParams(max_tokens=rng.randint(5, 40), temperature=0.0, ignore_eos=True) for _ in prompts
    ]
    results = []
    for runner in (graphs, eager):
        outputs = {}
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
            out, _ = _run_engine(runner, [prompt], p, max_num_seqs=16, max_num_batched_tokens=256)
            outputs[i] = out[(0, 0)]
        batch, _ = _run_engine(
            runner, prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
            max_num_seqs=16, max_num_batched_tokens=256,
        )  # fmt: skip
        results.append((outputs, batch))
    assert graphs.graphs.num_replays > 0
    if dtype == "float32":
        assert results[0] == results[1]
    else:  # the graph's split-KV choice differs from eager's: bf16 rounding may flip a near tie
        same = sum(results[0][1][k] == results[1][1][k] for k in results[0][1])
        assert same >= len(prompts) - 1, results
    assert all(len(results[0][0][i]) == p.max_tokens for i, p in enumerate(params))


@torch.inference_mode()
def test_padding_rows_leave_the_cache_untouched(tiny_model_dir) -> None:
    runner = _runner(tiny_model_dir, False, "float32")
    before = runner.kv.device_pool.clone()
    prompts = [list(range(1, n + 1)) for n in (3, 5, 20)]
    _run_engine(
        runner, prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        max_num_seqs=16, max_num_batched_tokens=256,
    )  # fmt: skip
    assert runner.graphs is not None and runner.graphs.num_replays == 3  # batches of 3, padded to 4
    changed = (runner.kv.device_pool != before).flatten(3).any(-1)  # [L, 2, num_blocks]
    # The KV of tokens 0 .. len + 2 of each sequence: 1 + 1 + 2 blocks, and no write from the padding row.
    assert int(changed.any(0).any(0).sum()) == 4
