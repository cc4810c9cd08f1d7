"""Qwen2 and Qwen3 checkpoints in the worker, against transformers' own Qwen2ForCausalLM / Qwen3ForCausalLM.

Qwen2 differs from Llama in its biased q/k/v projections (o_proj has none); Qwen3 in an RMSNorm over each q
and k head before RoPE and a head_dim that is not hidden_size / num_heads. The tiny presets of
scripts/make_model.py have these with random biases and norm gains, so that one lost or misplaced shows in
the logits; qwen3-tiny also ties lm_head to the embedding, as the small Qwen models do.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_runner import ModelRunner
from scripts.make_model import PRESETS, make_model
from tests.test_engine_correctness import _prompts, _run_engine, transformers_generate
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner

MAX_TOKENS = 20


@pytest.fixture(scope="module", params=["qwen2-tiny", "qwen3-tiny"])
def qwen_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("models") / request.param, preset=request.param, seed=0)


@pytest.fixture(scope="module")
def hf_qwen(qwen_model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(qwen_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def transformers_greedy(hf_qwen) -> list[list[int]]:
    """What transformers' own generate produces for each of the engine tests' prompts alone."""
    return transformers_generate(hf_qwen, _prompts(hf_qwen.config.vocab_size), MAX_TOKENS)


def test_config_and_modules_follow_the_architecture(qwen_model_dir: Path, hf_qwen) -> None:
    preset = PRESETS[qwen_model_dir.name]
    cfg = load_model_config(qwen_model_dir)
    assert cfg.model_type == preset.model_type == hf_qwen.config.model_type
    assert cfg.head_dim == preset.head_dim and cfg.tie_word_embeddings == preset.tie_word_embeddings
    hf_attn = hf_qwen.model.layers[0].self_attn
    assert (cfg.qkv_bias, cfg.o_proj_bias) == (
        hf_attn.q_proj.bias is not None,
        hf_attn.o_proj.bias is not None,
    )
    assert cfg.qk_norm == hasattr(hf_attn, "q_norm")
    if cfg.model_type == "qwen2":
        assert cfg.qkv_bias and not cfg.o_proj_bias and not cfg.qk_norm
    else:
        assert cfg.qk_norm and not cfg.qkv_bias and cfg.q_size != cfg.hidden_size

    model = make_runner(qwen_model_dir).model
    attn = model.layers[0].self_attn
    assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None) == (cfg.qkv_bias, cfg.o_proj_bias)
    assert (attn.q_norm is not None) == cfg.qk_norm
    if cfg.qk_norm:
        torch.testing.assert_close(attn.k_norm.weight, hf_attn.k_norm.weight, rtol=0, atol=0)
    assert (model.lm_head.weight is model.embed_tokens.weight) == cfg.tie_word_embeddings


def test_chunked_prefill_and_decodes_match_transformers_logits(qwen_model_dir: Path, hf_qwen) -> None:
    runner = make_runner(qwen_model_dir)
    driver = Driver(runner, seed=1)
    rng = random.Random(1)
    driver.add(0, _random_prompt(rng, 5, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 23, runner.vocab_size))
    driver.step({0: 5, 1: 23})
    driver.add(2, _random_prompt(rng, 41, runner.vocab_size))
    # The long prompt is split 18 + 23 (neither a block multiple) while the others decode beside it.
    driver.step({2: 18, 0: 1, 1: 1})
    driver.step({0: 1, 2: 23, 1: 1})
    for _ in range(5):
        driver.step({0: 1, 1: 1, 2: 1})
    assert [len(driver.tokens[s]) for s in range(3)] == [5 + 8, 23 + 8, 41 + 6]
    _assert_logits_match_hf(driver, hf_qwen, dict(driver.tokens))


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_greedy_matches_transformers_through_continuous_batching(
    qwen_model_dir: Path, transformers_greedy: list[list[int]], preemption_mode: str
) -> None:
    config = WorkerConfig(
        model=str(qwen_model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=40,
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
    if preemption_mode == "swap":
        assert m.swap_outs_total >= 2
    for i, expected in enumerate(transformers_greedy):
        assert ours[(i, 0)] == expected, f"prompt {i} (length {len(prompts[i])})"
    assert len({tuple(tokens) for tokens in ours.values()}) > len(prompts) // 2  # the outputs vary
