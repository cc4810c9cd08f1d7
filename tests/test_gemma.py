"""Gemma 2 and Gemma 3 (text) checkpoints in the worker, against transformers' own Gemma2ForCausalLM /
Gemma3ForCausalLM (float32, CPU, eager attention).

The tiny presets of scripts/make_model.py slide over windows of 16 tokens (every second layer for Gemma 2,
two of every three for Gemma 3), so the tests' prompts and outputs run well past the window; their norm
weights are random (Gemma scales by 1 + weight), Gemma 2 soft-caps scores (50) and logits (30), the query
scale is not head_dim's, and Gemma 3's sliding layers take their own RoPE base. A window, cap, norm or
RoPE that is lost or misplaced changes the logits.
"""

from __future__ import annotations

import json
import random
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.model_runner import ModelRunner
from scripts.make_model import PRESETS, make_model
from tests.kernels.conftest import HAS_CUDA, INTERPRET
from tests.test_engine_correctness import _prompts, _run_engine, transformers_generate
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner

MAX_TOKENS = 24


@pytest.fixture(scope="module", params=["gemma2-tiny", "gemma3-tiny"])
def gemma_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / request.param, preset=request.param, seed=0)


@pytest.fixture(scope="module")
def hf_gemma(gemma_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(
        gemma_model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def transformers_greedy(hf_gemma) -> list[list[int]]:
    return transformers_generate(hf_gemma, _prompts(hf_gemma.config.vocab_size), MAX_TOKENS)


def test_the_loader_reads_back_the_preset(gemma_model_dir: Path, hf_gemma) -> None:
    loaded = load_model_config(gemma_model_dir)
    preset = PRESETS[gemma_model_dir.name]
    expected = {f.name: getattr(preset, f.name) for f in fields(ModelConfig)}
    expected |= {"vocab_size": loaded.vocab_size, "eos_token_ids": loaded.eos_token_ids}
    assert {f.name: getattr(loaded, f.name) for f in fields(ModelConfig)} == expected
    # Windows are applied, so the model is not capped to its window; they are where transformers has them.
    assert (
        loaded.max_position_embeddings == hf_gemma.config.max_position_embeddings > max(loaded.layer_windows)
    )
    hf_types = hf_gemma.config.layer_types
    assert [w > 0 for w in loaded.layer_windows] == [t == "sliding_attention" for t in hf_types]
    assert 0 < loaded.layer_windows.count(0) < loaded.num_layers  # global and sliding layers both

    model = make_runner(gemma_model_dir).model
    for layer, window in zip(model.layers, loaded.layer_windows, strict=True):
        attn = layer.self_attn
        assert (attn.sliding_window, attn.softcap) == (window, loaded.attn_logit_softcap)
        assert attn.scale == loaded.query_pre_attn_scalar**-0.5 != loaded.head_dim**-0.5
    assert model.lm_head.weight is model.embed_tokens.weight


def test_gemma3_reads_both_rope_layouts(tmp_path: Path) -> None:
    # transformers 5 writes RoPE per layer type; Gemma 3's published configs (older transformers) flat keys.
    base = {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 64,
        "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
        "intermediate_size": 128, "vocab_size": 100, "sliding_window": 512, "max_position_embeddings": 32768,
    }  # fmt: skip
    flat = {**base, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window_pattern": 6,
            "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    nested = {**base, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    }, "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 2}  # fmt: skip
    configs = []
    for name, raw in (("flat", flat), ("nested", nested)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(raw))
        configs.append(load_model_config(tmp_path / name))
    assert configs[0] == configs[1]
    cfg = configs[0]
    assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.rope_scaling.factor) == (1e6, 1e4, 8.0)
    assert cfg.layer_windows == ((512,) * 5 + (0,)) * 2 and cfg.max_position_embeddings == 32768
    assert cfg.qk_norm and cfg.hidden_activation == "gelu_pytorch_tanh"


def test_chunked_prefill_and_decodes_past_the_window_match_transformers_logits(
    gemma_model_dir: Path, hf_gemma
) -> None:
    runner = make_runner(gemma_model_dir)
    driver = Driver(runner, seed=1)
    rng = random.Random(1)
    driver.add(0, _random_prompt(rng, 5, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 23, runner.vocab_size))
    driver.step({0: 5, 1: 23})
    driver.add(2, _random_prompt(rng, 41, runner.vocab_size))
    # The long prompt is split 18 + 23 (neither a block multiple) while the others decode beside it.
    driver.step({2: 18, 0: 1, 1: 1})
    driver.step({0: 1, 2: 23, 1: 1})
    for _ in range(14):  # sequence 0 passes the window of 16 while decoding
        driver.step({0: 1, 1: 1, 2: 1})
    assert [len(driver.tokens[s]) for s in range(3)] == [5 + 17, 23 + 17, 41 + 15]
    _assert_logits_match_hf(driver, hf_gemma, dict(driver.tokens))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_matches_transformers_through_continuous_batching(
    gemma_model_dir: Path, transformers_greedy: list[list[int]], preemption_mode: str
) -> None:
    config = WorkerConfig(
        model=str(gemma_model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=48,
        swap_space=0.05,
    )  # fmt: skip
    runner = ModelRunner(config)
    prompts = _prompts(runner.vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    ours, scheduler = _run_engine(
        runner, prompts, params, max_num_seqs=8, max_num_batched_tokens=48,
        num_cpu_blocks=runner.num_cpu_blocks, preemption_mode=preemption_mode,
    )  # fmt: skip
    m = scheduler.metrics
    assert m.preemptions_total >= 2 and m.prefix_cache_hits_total > 0
    for i, expected in enumerate(transformers_greedy):
        assert ours[(i, 0)] == expected, f"prompt {i} (length {len(prompts[i])})"
    assert len({tuple(tokens) for tokens in ours.values()}) > len(prompts) // 2  # the outputs vary


def test_without_the_window_the_logits_differ(gemma_model_dir: Path, hf_gemma) -> None:
    # Guards the tests above against a preset whose windows would not matter: the same model with every
    # layer global gives other logits past the window.
    runner = make_runner(gemma_model_dir)
    for layer in runner.model.layers:
        layer.self_attn.sliding_window = 0
    driver = Driver(runner, seed=2)
    driver.add(0, _random_prompt(random.Random(2), 40, runner.vocab_size))
    driver.step({0: 40})
    with torch.no_grad():
        expected = hf_gemma(torch.tensor([driver.tokens[0][:40]])).logits[0, -1]
    (_, index, row) = driver.records[-1]
    assert index == 39 and (row - expected).abs().max() > 1e-2


@pytest.mark.skipif(not (INTERPRET or HAS_CUDA), reason="Triton needs TRITON_INTERPRET=1 or CUDA")
def test_triton_backend_matches_transformers_logits(gemma_model_dir: Path, hf_gemma) -> None:
    # The kernels' window and soft-cap through the whole model (float32; on CUDA too where there is one): a
    # prefill past the window, a chunked one and decodes beside it (the mixed path), decodes alone.
    device = "cpu" if INTERPRET else "cuda"
    runner = make_runner(gemma_model_dir, device=device, attention_backend="triton")
    driver = Driver(runner, seed=3)
    rng = random.Random(3)
    driver.add(0, _random_prompt(rng, 30, runner.vocab_size))
    driver.step({0: 30})
    driver.add(1, _random_prompt(rng, 37, runner.vocab_size))
    driver.step({0: 1, 1: 20})
    driver.step({0: 1, 1: 17})
    for _ in range(3):
        driver.step({0: 1, 1: 1})
    _assert_logits_match_hf(driver, hf_gemma, dict(driver.tokens))
