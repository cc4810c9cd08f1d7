"""--load-format dummy on a GPU, at the shapes the benchmarks run (skipped without CUDA; on the GPU machine:
`pytest -m gpu tests/test_dummy_weights_gpu.py`): bf16 activations stay finite and the logits spread, FP8
products run on the random weights, and the weights are drawn on the device, not through the host."""

from __future__ import annotations

import random
import resource
from pathlib import Path

import pytest
import torch

from pagedserve.common.config import WorkerConfig
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.models.fp8_linear import Fp8Linear
from scripts.make_model import make_model
from tests.test_model_runner import Driver, _random_prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# Real shapes that fit a test's time and memory (the benchmarks run Gemma-2-9B, Phi-3-mini, Qwen3-30B-A3B)
PRESETS = ("llama-3.2-1b", "gemma-2-2b", "phi-3-mini", "qwen3-0.6b")


def _runner(model_dir: Path, **kw: object) -> ModelRunner:
    cfg = WorkerConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", num_kv_blocks=256, max_num_seqs=8,
        enforce_eager=True, swap_space=0, max_num_batched_tokens=512, load_format="dummy", **kw,
    )  # fmt: skip
    return ModelRunner(cfg, attention_backend="triton")


def _logits(runner: ModelRunner) -> torch.Tensor:  # [rows, vocab] float32: prefills, then decodes
    driver = Driver(runner, seed=1)
    rng = random.Random(1)
    driver.add(0, _random_prompt(rng, 200, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 37, runner.vocab_size))
    driver.step({0: 200, 1: 37})
    for _ in range(8):
        driver.step({0: 1, 1: 1})
    return torch.stack([row.float() for _, _, row in driver.records])


@pytest.mark.parametrize("preset", PRESETS)
def test_random_weights_keep_bf16_activations_finite_and_logits_spread(preset: str, tmp_path: Path) -> None:
    model_dir = make_model(tmp_path / preset, preset=preset, weights=False)
    torch.zeros(1, device="cuda")  # the CUDA context's host memory, before the measurement
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    runner = _runner(model_dir)
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    assert rss_growth < weight_bytes / 2, (rss_growth, weight_bytes)  # no host copy of the model
    logits = _logits(runner)
    assert torch.isfinite(logits).all()
    spread = logits.std(dim=-1)
    assert spread.min() > 0.1 and logits.abs().max() < 1e4, (spread.min(), logits.abs().max())
    # rows differ by context (a random model's greedy tokens may still repeat one token: docs/models.md)
    assert (logits - logits[0]).abs().amax() > 0.1


def test_fp8_products_on_random_weights_follow_bf16(tmp_path: Path) -> None:
    """--quantization fp8 quantizes the same random bf16 weights (same seed): FP8 products on Hopper, whose
    logits follow the bf16 model's closely."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("FP8 products need Hopper")
    model_dir = make_model(tmp_path / "m", preset="llama-3.2-1b", weights=False)
    bf16 = _logits(_runner(model_dir))
    runner = _runner(model_dir, quantization="fp8")
    proj = runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(proj, Fp8Linear) and proj.fp8_matmul and proj.weight.dtype == torch.float8_e4m3fn
    fp8 = _logits(runner)
    assert torch.isfinite(fp8).all()
    # the prefills' rows: the same contexts on both sides (the decodes may sample apart)
    correlation = torch.corrcoef(torch.stack([bf16[:2].flatten(), fp8[:2].flatten()]))[0, 1].item()
    assert correlation > 0.8, correlation  # unrelated logits would be near 0
