"""Phi-3 / Phi-4 checkpoints (worker/models/phi3.py) against transformers' Phi3ForCausalLM: fused q/k/v and
gate/up tensors in the checkpoint, longrope scaling with a partial rotary factor, tied and untied heads, the
sliding window on every layer, and tensor parallelism taking each rank's rows of q, k and v (and gate, up)
separately."""

from __future__ import annotations

import random
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Phi3Config, Phi3ForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.loader import _rank_slices, load_model_config
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.models.phi3 import PHI3_WEIGHTS
from pagedserve.worker.parallel import shard_model_config
from scripts.make_model import PRESETS, make_model
from tests.test_engine_correctness import _run_engine, transformers_generate
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner
from tests.test_tensor_parallel import _run_ranks, check_two_ranks_match_one_process

BASE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
    vocab_size=300, initializer_range=0.1, pad_token_id=None, eos_token_id=None, bos_token_id=None,
)  # fmt: skip
LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.2, 1.1, 1.3],  # 4 = head_dim 16 x partial 0.5 / 2
    "long_factor": [1.0, 3.0, 7.0, 15.0],
}
VARIANTS = {
    "plain": dict(max_position_embeddings=128),
    # Phi-3.5 / Phi-4-mini: longrope past a pretraining length of 24, half of each head rotated, tied head
    "longrope": dict(
        max_position_embeddings=128,
        original_max_position_embeddings=24,
        rope_parameters=LONGROPE,
        partial_rotary_factor=0.5,
        tie_word_embeddings=True,
    ),  # fmt: skip
}


def save_phi3(path: Path, variant: str, seed: int = 0) -> tuple[Path, Phi3ForCausalLM]:
    config = Phi3Config(**BASE, **VARIANTS[variant])
    torch.manual_seed(seed)
    hf = Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # unit gains would hide a misplaced norm
    hf.save_pretrained(path)
    return path, hf


@pytest.fixture(scope="module", params=list(VARIANTS))
def phi3(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    return save_phi3(tmp_path_factory.mktemp("phi3") / request.param, request.param)


def test_config_and_weights_follow_the_checkpoint(phi3) -> None:
    model_dir, hf = phi3
    cfg = load_model_config(model_dir)
    assert cfg.model_type == "phi3" and not cfg.qkv_bias and not cfg.o_proj_bias
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    assert cfg.rotary_dim == int(16 * hf.config.rope_parameters["partial_rotary_factor"])
    if cfg.rope_scaling is not None:
        assert (
            cfg.rope_scaling.rope_type == "longrope"
            and cfg.rope_scaling.original_max_position_embeddings == 24
        )
        assert cfg.rope_scaling.factor == 128 / 24  # no factor in the config: the ratio of the lengths
    model = make_runner(model_dir).model
    torch.testing.assert_close(
        model.layers[1].self_attn.qkv_proj.weight, hf.model.layers[1].self_attn.qkv_proj.weight
    )
    torch.testing.assert_close(
        model.layers[0].mlp.gate_up_proj.weight, hf.model.layers[0].mlp.gate_up_proj.weight
    )
    assert (model.lm_head.weight is model.embed_tokens.weight) == cfg.tie_word_embeddings


@pytest.mark.parametrize("fused_ops", [False, True])
def test_chunked_prefill_and_decodes_match_transformers_logits(phi3, fused_ops: bool) -> None:
    model_dir, hf = phi3
    # With longrope, max_model_len 128 > 24 takes the long factors: the sequences are longer than 24, as
    # transformers needs them to take the long factors too.
    runner = make_runner(model_dir, fused_ops=fused_ops)
    driver = Driver(runner, seed=1)
    rng = random.Random(1)
    driver.add(0, _random_prompt(rng, 26, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 41, runner.vocab_size))
    driver.step({0: 26, 1: 17})
    driver.step({0: 1, 1: 24})
    for _ in range(5):
        driver.step({0: 1, 1: 1})
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))


def test_longrope_within_the_pretraining_length_takes_the_short_factors(tmp_path: Path) -> None:
    model_dir, hf = save_phi3(tmp_path, "longrope", seed=1)
    runner = make_runner(model_dir, max_model_len=24)
    driver = Driver(runner, seed=2)
    rng = random.Random(2)
    driver.add(0, _random_prompt(rng, 9, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 15, runner.vocab_size))
    driver.step({0: 9, 1: 15})
    for _ in range(7):
        driver.step({0: 1, 1: 1})
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))


def test_greedy_matches_transformers_generate_through_continuous_batching(phi3) -> None:
    model_dir, hf = phi3
    rng = random.Random(5)
    prompts = [_random_prompt(rng, n, 300) for n in (25, 30, 33, 47, 64)]
    prompts.append(prompts[3][:30] + [1, 2, 3])  # a shared prefix for the prefix cache
    expected = transformers_generate(hf, prompts, 16)
    config = WorkerConfig(model=str(model_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=32)
    runner = ModelRunner(config)
    ours, scheduler = _run_engine(
        runner,
        prompts,
        SamplingParams(max_tokens=16, temperature=0.0),
        max_num_seqs=4,
        max_num_batched_tokens=40,
    )
    assert scheduler.metrics.preemptions_total >= 1
    for i, want in enumerate(expected):
        assert ours[(i, 0)] == want, f"prompt {i}"


def test_sliding_window_applies_to_every_layer_over_the_whole_context(tmp_path: Path) -> None:
    config = Phi3Config(**BASE, max_position_embeddings=4096, sliding_window=2047)
    config.save_pretrained(tmp_path)
    loaded = load_model_config(tmp_path)  # Phi-3-mini-4k's window (tests/test_sliding_windows.py: its logits)
    assert loaded.max_position_embeddings == 4096
    assert loaded.layer_windows == (2047,) * config.num_hidden_layers


def test_each_rank_takes_its_rows_of_every_fused_part(phi3) -> None:
    model_dir, _ = phi3
    cfg = load_model_config(model_dir)  # q 64 rows (4 heads x 16), k and v 32 each; gate and up 96 each
    local = shard_model_config(cfg, 2)
    qkv = _rank_slices("layers.0.self_attn.qkv_proj.weight", PHI3_WEIGHTS, local, 150, 1, 2)
    assert qkv == [(slice(32, 64),), (slice(80, 96),), (slice(112, 128),)]  # rank 1's q, k, v heads
    gate_up = _rank_slices("layers.0.mlp.gate_up_proj.weight", PHI3_WEIGHTS, local, 150, 0, 2)
    assert gate_up == [(slice(0, 48),), (slice(96, 144),)]
    assert _rank_slices("layers.0.self_attn.o_proj.weight", PHI3_WEIGHTS, local, 150, 1, 2) == (
        slice(None),
        slice(32, 64),
    )


def test_two_ranks_match_one_process(phi3, tmp_path: Path) -> None:
    """Gloo on the CPU: two ranks' tokens equal one process's (tests/test_tensor_parallel.py's harness)."""
    model_dir, _ = phi3
    _run_ranks({"tiny": model_dir}, tmp_path)
    ranks = [torch.load(tmp_path / f"tiny-rank{rank}.pt") for rank in range(2)]
    check_two_ranks_match_one_process(model_dir, ranks, "cpu")


def test_the_phi3_tiny_preset_reads_back_and_matches_transformers(tmp_path: Path) -> None:
    """scripts/make_model.py's Phi-3 path (the phi-3-mini preset's, at a tiny shape with longrope)."""
    model_dir = make_model(tmp_path / "phi3-tiny", preset="phi3-tiny")
    loaded = load_model_config(model_dir)
    preset = PRESETS["phi3-tiny"]
    expected = {f.name: getattr(preset, f.name) for f in fields(ModelConfig)}
    expected |= {"vocab_size": loaded.vocab_size, "eos_token_ids": loaded.eos_token_ids}
    assert {f.name: getattr(loaded, f.name) for f in fields(ModelConfig)} == expected
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    runner = make_runner(model_dir, max_model_len=300)  # past 256: the long factors
    driver = Driver(runner, seed=6)
    driver.add(0, _random_prompt(random.Random(6), 260, runner.vocab_size))
    driver.step({0: 260})
    for _ in range(3):
        driver.step({0: 1})
    _assert_logits_match_hf(driver, hf, dict(driver.tokens))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("piecewise_graphs", [False, True])
def test_gpu_greedy_matches_transformers_with_kernels_and_graphs(
    tmp_path: Path, piecewise_graphs: bool
) -> None:
    """The Triton kernels (the fused RoPE rotating half of each head in place) and CUDA graphs, in float32."""
    model_dir, hf = save_phi3(tmp_path, "longrope", seed=3)
    rng = random.Random(7)
    prompts = [_random_prompt(rng, n, 300) for n in (25, 31, 40, 57)]  # past 24: the long factors
    expected = transformers_generate(hf, prompts, 12)
    config = WorkerConfig(
        model=str(model_dir), device="cuda", dtype="float32", block_size=16, num_kv_blocks=64,
        max_num_seqs=4, piecewise_graphs=piecewise_graphs,
    )  # fmt: skip
    runner = ModelRunner(config, attention_backend="triton")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    ours, _ = _run_engine(
        runner, prompts, params, max_num_seqs=4, max_num_batched_tokens=config.max_num_batched_tokens
    )
    for i, want in enumerate(expected):
        assert ours[(i, 0)] == want, f"prompt {i}"
