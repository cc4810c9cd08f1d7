"""The model with every Triton kernel in it (fused elementwise ops and the attention kernels), against
transformers' logits: Llama, Qwen2 (qkv biases) and Qwen3 (q/k norms over strided heads, tied embeddings)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from scripts.make_model import make_model
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner


@pytest.mark.parametrize("preset", ["tiny", "qwen2-tiny", "qwen3-tiny"])
def test_fused_ops_model_matches_transformers_logits(
    device: torch.device, tmp_path: Path, preset: str
) -> None:
    model_dir = make_model(tmp_path / preset, preset=preset, seed=0)
    runner = make_runner(model_dir, device=str(device), attention_backend="triton", fused_ops=True)
    assert runner.model.layers[0].mlp._act_and_mul.__module__ == "pagedserve.kernels.fused_ops"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    driver = Driver(runner, seed=2)
    rng = random.Random(2)
    driver.add(0, _random_prompt(rng, 6, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 19, runner.vocab_size))
    driver.step({0: 6, 1: 19})
    driver.add(2, _random_prompt(rng, 30, runner.vocab_size))
    driver.step({0: 1, 1: 1, 2: 13})  # decodes first, then a chunk: both attention launches and the norms
    driver.step({0: 1, 1: 1, 2: 17})
    for _ in range(3):
        driver.step({0: 1, 1: 1, 2: 1})
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))
