"""Sliding-window attention in the Llama-layer families (Mistral v0.1, Phi-3, Qwen2/Qwen3 with
use_sliding_window): served past the window to the model's full context, each layer attending over its own
window, against transformers' models (which apply the same windows) in float32. Prefills longer than the
window, a chunked one beside decodes (the mixed path) and decodes past it, on the torch backend and the
Triton kernels (under TRITON_INTERPRET=1, or on CUDA)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from tests.kernels.conftest import HAS_CUDA, INTERPRET
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner

WINDOW = 12
SHAPE = dict(
    vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
    num_hidden_layers=3, max_position_embeddings=256, initializer_range=0.1, pad_token_id=None,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip
FAMILIES: dict[str, tuple[Any, Any, dict[str, Any], tuple[int, ...]]] = {
    # config class, model class, window settings, the windows each layer should get
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": WINDOW}, (WINDOW,) * 3),
    "phi3": (Phi3Config, Phi3ForCausalLM, {"sliding_window": WINDOW}, (WINDOW,) * 3),
    # Qwen slides from max_window_layers on: the first layer global, the others windowed (a mixed model)
    "qwen2": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        (0, WINDOW, WINDOW),
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def windowed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Any, tuple]:
    config_cls, model_cls, window, layer_windows = FAMILIES[request.param]
    config = config_cls(**SHAPE, **window)
    torch.manual_seed(0)
    hf = model_cls(config).eval()
    path = tmp_path_factory.mktemp("windowed") / request.param
    hf.save_pretrained(path)
    return path, hf, layer_windows


def _drive(runner: Any, seed: int) -> Driver:
    driver = Driver(runner, seed=seed)
    rng = random.Random(seed)
    driver.add(0, _random_prompt(rng, 2 * WINDOW + 5, runner.vocab_size))  # a prefill past the window
    driver.step({0: 2 * WINDOW + 5})
    driver.add(1, _random_prompt(rng, 3 * WINDOW, runner.vocab_size))
    driver.step({0: 1, 1: WINDOW + 3})  # a chunk beside a decode: the mixed path
    driver.step({0: 1, 1: 2 * WINDOW - 3})
    for _ in range(WINDOW + 2):  # decodes well past the window
        driver.step({0: 1, 1: 1})
    return driver


def test_windows_are_applied_and_the_context_is_not_capped(windowed) -> None:
    model_dir, hf, layer_windows = windowed
    runner = make_runner(model_dir)
    assert runner.model_config.layer_windows == layer_windows
    assert runner.max_model_len == SHAPE["max_position_embeddings"]  # no longer capped to the window
    assert [layer.self_attn.sliding_window for layer in runner.model.layers] == list(layer_windows)
    driver = _drive(runner, seed=1)
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))


@pytest.mark.skipif(not (INTERPRET or HAS_CUDA), reason="Triton needs TRITON_INTERPRET=1 or CUDA")
def test_triton_kernels_apply_the_windows(windowed) -> None:
    model_dir, hf, _ = windowed
    device = "cpu" if INTERPRET else "cuda"
    runner = make_runner(model_dir, device=device, attention_backend="triton")
    driver = _drive(runner, seed=2)
    _assert_logits_match_hf(driver, hf.to(device), dict(driver.tokens))
    hf.to("cpu")


def test_without_the_windows_the_logits_differ(windowed) -> None:
    """Guards the tests above against windows that would not matter at these lengths."""
    model_dir, hf, _ = windowed
    runner = make_runner(model_dir)
    for layer in runner.model.layers:
        layer.self_attn.sliding_window = 0
    driver = Driver(runner, seed=3)
    driver.add(0, _random_prompt(random.Random(3), 3 * WINDOW, runner.vocab_size))
    driver.step({0: 3 * WINDOW})
    with torch.no_grad():
        expected = hf(torch.tensor([driver.tokens[0][: 3 * WINDOW]])).logits[0, -1]
    (_, index, row) = driver.records[-1]
    assert index == 3 * WINDOW - 1 and (row - expected).abs().max() > 1e-2
