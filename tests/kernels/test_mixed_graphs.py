"""Piecewise graphs for prefill and mixed steps (worker/cuda_graphs.py MixedGraphs) against transformers'
logits: the pieces hand q, k, v, the residual stream and the attention output over through static buffers,
and steps are padded to the next token count that has graphs. On CUDA the pieces are captured and replayed;
under the interpreter the same pieces run eagerly."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.worker.cuda_graphs import MixedGraphs, token_buckets
from scripts.make_model import make_model
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner


def test_token_buckets_cover_every_count_up_to_the_step_budget() -> None:
    assert token_buckets(8192) == [16, 32, 64, 128, *range(256, 2048, 256), *range(2048, 8192, 512), 8192]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 512, 768, 1000]
    assert token_buckets(16) == [16] and token_buckets(5) == [5]
    assert token_buckets(64, step=16) == [1, 2, 4, 8, 16, 32, 48, 64]


@pytest.mark.parametrize("preset", ["tiny", "qwen3-tiny"])
def test_piecewise_graphs_match_transformers_logits(
    device: torch.device, tmp_path: Path, preset: str
) -> None:
    model_dir = make_model(tmp_path / preset, preset=preset, seed=0)
    runner = make_runner(
        model_dir, device=str(device), attention_backend="triton", fused_ops=True, max_num_seqs=8
    )
    graphs = MixedGraphs(
        runner.model, runner.kv.layers, 64, device, bucket_step=16, capture=device.type == "cuda"
    )
    runner.mixed_graphs = graphs
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    driver = Driver(runner, seed=3)
    rng = random.Random(3)
    driver.add(0, _random_prompt(rng, 6, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 19, runner.vocab_size))
    driver.step({0: 6, 1: 19})  # 25 tokens, padded to 32
    driver.add(2, _random_prompt(rng, 30, runner.vocab_size))
    driver.step({0: 1, 1: 1, 2: 13})  # decodes and a chunk: 15, padded to 16
    driver.step({0: 1, 1: 1, 2: 17})  # the rest of that prompt: 19, padded to 32
    for _ in range(2):
        driver.step({0: 1, 1: 1, 2: 1})
    driver.add(3, _random_prompt(rng, 70, runner.vocab_size))
    driver.step({0: 1, 1: 1, 2: 1, 3: 61})  # 64: the largest size, no padding
    driver.step({0: 1, 1: 1, 2: 1, 3: 9})  # 12
    runs = graphs.num_runs
    driver.add(4, _random_prompt(rng, 80, runner.vocab_size))
    driver.step({4: 80})  # past the largest size: the eager forward
    assert graphs.num_runs == runs
    driver.step({0: 1, 1: 1, 2: 1, 3: 1, 4: 1})
    assert runs >= 5
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))
