"""Mixture-of-experts checkpoints (Mixtral, Qwen3-MoE, Qwen2-MoE) in the worker, against transformers' own
MixtralForCausalLM / Qwen3MoeForCausalLM / Qwen2MoeForCausalLM, and the tensor-parallel split of the experts.

The tiny checkpoints are made by transformers (`from_config`, `save_pretrained`, which writes each expert's
projections apart) with random norm gains and biases, and a router scaled up so that the top-k choice is
decisive (near-tied router probabilities would let float32 noise pick another expert). Qwen3-MoE's has a
dense layer among the sparse ones (`mlp_only_layers`), biased attention and no top-k renormalisation;
Qwen2-MoE's sparse layers are every second one (`decoder_sparse_step`), each with a shared expert.
"""

from __future__ import annotations

import random
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.attention import get_attention_backend
from pagedserve.worker.loader import load_model_config, load_weights
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.models.llama import GatedMLP
from pagedserve.worker.models.moe import SparseMoE
from pagedserve.worker.models.registry import build_model
from pagedserve.worker.parallel import ParallelContext
from scripts.make_model import PRESETS, make_model
from tests.test_engine_correctness import _prompts, _run_engine, transformers_generate
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner

MAX_TOKENS = 16
COMMON = dict(
    hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
    max_position_embeddings=256, initializer_range=0.1, intermediate_size=96,
)  # fmt: skip


def tiny_moe_config(family: str):  # a transformers PretrainedConfig
    if family == "mixtral":
        return MixtralConfig(
            **COMMON, num_local_experts=6, num_experts_per_tok=2, architectures=["MixtralForCausalLM"]
        )
    if family == "qwen2_moe":
        return Qwen2MoeConfig(
            **COMMON, moe_intermediate_size=48, shared_expert_intermediate_size=80, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=2,
            architectures=["Qwen2MoeForCausalLM"],
        )  # fmt: skip
    return Qwen3MoeConfig(
        **COMMON, head_dim=32, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=False, mlp_only_layers=[1], attention_bias=True, architectures=["Qwen3MoeForCausalLM"],
    )  # fmt: skip


def make_tiny_moe(out: Path, family: str, seed: int = 0) -> Path:
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(tiny_moe_config(family), dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith("gate.weight"):  # the routers
                p.normal_(0.0, 1.0)
    hf.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe"])
def moe_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("models") / request.param, request.param)


@pytest.fixture(scope="module")
def hf_moe(moe_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()


def test_config_and_layers_follow_the_checkpoint(moe_dir: Path, hf_moe) -> None:
    cfg = load_model_config(moe_dir)
    hf_cfg = hf_moe.config
    assert cfg.model_type == hf_cfg.model_type
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (
        hf_cfg.num_experts,
        hf_cfg.num_experts_per_tok,
    )
    model = make_runner(moe_dir).model
    kinds = [type(layer.mlp) for layer in model.layers]
    if cfg.model_type == "mixtral":
        assert cfg.norm_topk_prob and cfg.moe_intermediate_size == hf_cfg.intermediate_size
        assert kinds == [SparseMoE] * 3 and cfg.dense_layers == ()
    elif cfg.model_type == "qwen3_moe":
        assert not cfg.norm_topk_prob and cfg.qk_norm and cfg.qkv_bias and cfg.o_proj_bias
        assert kinds == [SparseMoE, GatedMLP, SparseMoE] and cfg.dense_layers == (1,)
    else:  # qwen2_moe: every second layer sparse, with a shared expert
        assert cfg.norm_topk_prob and cfg.qkv_bias and not cfg.o_proj_bias
        assert kinds == [GatedMLP, SparseMoE, GatedMLP] and cfg.dense_layers == (0, 2)
        assert cfg.shared_expert_intermediate_size == 80
        shared = hf_moe.model.layers[1].mlp.shared_expert
        gate_up = torch.cat([shared.gate_proj.weight, shared.up_proj.weight])
        torch.testing.assert_close(model.layers[1].mlp.shared_gate_up_proj.weight, gate_up, rtol=0, atol=0)
    sparse = cfg.dense_layers[0] + 1 if cfg.dense_layers == (0, 2) else 0
    hf_experts = hf_moe.model.layers[sparse].mlp.experts
    ours = model.layers[sparse].mlp.experts
    torch.testing.assert_close(ours.gate_up_proj, hf_experts.gate_up_proj, rtol=0, atol=0)
    torch.testing.assert_close(ours.down_proj, hf_experts.down_proj, rtol=0, atol=0)


def test_chunked_prefill_and_decodes_match_transformers_logits(moe_dir: Path, hf_moe) -> None:
    runner = make_runner(moe_dir)
    driver = Driver(runner, seed=1)
    rng = random.Random(1)
    driver.add(0, _random_prompt(rng, 5, runner.vocab_size))
    driver.add(1, _random_prompt(rng, 23, runner.vocab_size))
    driver.step({0: 5, 1: 23})
    driver.add(2, _random_prompt(rng, 41, runner.vocab_size))
    driver.step({2: 18, 0: 1, 1: 1})  # a chunk beside decodes
    driver.step({0: 1, 2: 23, 1: 1})
    for _ in range(4):
        driver.step({0: 1, 1: 1, 2: 1})
    _assert_logits_match_hf(driver, hf_moe, dict(driver.tokens))


def test_greedy_matches_transformers_generate_through_continuous_batching(moe_dir: Path, hf_moe) -> None:
    prompts = _prompts(hf_moe.config.vocab_size)
    expected = transformers_generate(hf_moe, prompts, MAX_TOKENS)
    config = WorkerConfig(model=str(moe_dir), device="cpu", dtype="float32", block_size=4, num_kv_blocks=48)
    runner = ModelRunner(config)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    ours, scheduler = _run_engine(runner, prompts, params, max_num_seqs=8, max_num_batched_tokens=48)
    assert scheduler.metrics.prefix_cache_hits_total > 0
    for i, tokens in enumerate(expected):
        assert ours[(i, 0)] == tokens, f"prompt {i} (length {len(prompts[i])})"
    assert len({tuple(tokens) for tokens in ours.values()}) > len(prompts) // 2  # the outputs vary


def test_tensor_parallel_shards_of_the_experts_sum_to_the_whole(
    moe_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each rank of two loads its half of every expert (gate/up rows, down columns; the router whole), and
    the two ranks' partial MoE outputs, before the all-reduce, add up to the single process's output."""
    cfg = load_model_config(moe_dir)
    backend = get_attention_backend("torch")

    def load(parallel: ParallelContext | None):  # -> CausalLM
        model = build_model(cfg, 64, backend, torch.float32, torch.device("cpu"), parallel)
        load_weights(model, cfg, moe_dir, parallel)
        return model

    whole = load(None)
    # No process group here: the all-reduce returns the rank's own partial sum.
    monkeypatch.setattr(ParallelContext, "all_reduce", lambda self, x: x)
    ranks = [load(ParallelContext(rank, 2)) for rank in range(2)]
    sparse = next(i for i in range(cfg.num_layers) if i not in cfg.dense_layers)
    moe = ranks[0].layers[sparse].mlp
    assert moe.experts.gate_up_proj.shape == (cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size)
    assert moe.experts.down_proj.shape == (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // 2)
    if cfg.shared_expert_intermediate_size:  # Qwen2-MoE's shared expert is split likewise
        assert moe.shared_down_proj.weight.shape == (
            cfg.hidden_size,
            cfg.shared_expert_intermediate_size // 2,
        )
    x = torch.randn(13, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        parts = [model.layers[sparse].mlp(x) for model in ranks]
        torch.testing.assert_close(parts[0] + parts[1], whole.layers[sparse].mlp(x), rtol=1e-5, atol=1e-5)


def test_the_qwen3_moe_preset_reads_back_as_written(tmp_path: Path) -> None:
    loaded = load_model_config(make_model(tmp_path / "m", preset="qwen3-moe-tiny"))
    preset = PRESETS["qwen3-moe-tiny"]
    expected = {f.name: getattr(preset, f.name) for f in fields(ModelConfig)}
    expected |= {"vocab_size": loaded.vocab_size, "eos_token_ids": loaded.eos_token_ids}  # the tokenizer's
    assert {f.name: getattr(loaded, f.name) for f in fields(ModelConfig)} == expected
    assert loaded.num_experts == 8 and PRESETS["qwen3-30b-a3b"].num_experts == 128
