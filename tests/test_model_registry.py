"""The registry of model families (worker/models/registry.py): every family resolves from a config.json that
transformers' own config class writes, an unknown one is refused with the list of supported ones, and every
family satisfies the interface the runner and the CUDA graphs use, with logits that match transformers'."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from pagedserve.worker.attention import get_attention_backend
from pagedserve.worker.cuda_graphs import MixedGraphs
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.models.interface import AttentionShape, CausalLM
from pagedserve.worker.models.registry import (
    BY_ARCHITECTURE,
    BY_MODEL_TYPE,
    FAMILIES,
    UnsupportedModelError,
    build_model,
    family_of,
)
from tests.test_model_runner import Driver, _assert_logits_match_hf, _random_prompt, make_runner

TINY = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 96,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "initializer_range": 0.1,
    "pad_token_id": None,  # Phi-3's default (32000) is outside this vocabulary
}
FAMILY_IDS = [f.__name__ for f in FAMILIES]


def _hf_config(family: type[CausalLM], with_architecture: bool = True):  # a transformers PretrainedConfig
    architectures = [family.architectures[0]] if with_architecture else None
    return AutoConfig.for_model(family.model_types[0], architectures=architectures, **TINY)


@pytest.mark.parametrize("family", FAMILIES, ids=FAMILY_IDS)
@pytest.mark.parametrize("with_architecture", [True, False], ids=["architectures", "model_type"])
def test_every_family_resolves_from_a_transformers_config(
    tmp_path: Path, family: type[CausalLM], with_architecture: bool
) -> None:
    _hf_config(family, with_architecture).save_pretrained(tmp_path)
    cfg = load_model_config(tmp_path)
    assert family_of(cfg) is family
    assert cfg.model_type == family.model_types[0]


def test_the_architecture_wins_over_the_model_type(tmp_path: Path) -> None:
    raw = {**TINY, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3_custom"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_model_config(tmp_path)
    assert family_of(cfg) is BY_ARCHITECTURE["Qwen3ForCausalLM"] and cfg.qk_norm


def test_an_unknown_model_is_refused_with_the_supported_ones(tmp_path: Path) -> None:
    raw = {**TINY, "architectures": ["FalconForCausalLM"], "model_type": "falcon"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError) as raised:
        load_model_config(tmp_path)
    message = str(raised.value)
    assert "'falcon'" in message and "FalconForCausalLM" in message
    assert all(name in message for name in [*BY_ARCHITECTURE, *BY_MODEL_TYPE])
    assert isinstance(raised.value, ValueError)  # what callers of load_model_config have always caught


def test_every_name_has_one_family() -> None:
    assert sorted(BY_ARCHITECTURE) == sorted(a for f in FAMILIES for a in f.architectures)
    assert sorted(BY_MODEL_TYPE) == sorted(t for f in FAMILIES for t in f.model_types)
    assert all(f.architectures and f.model_types for f in FAMILIES)


@pytest.fixture(params=FAMILIES, ids=FAMILY_IDS)
def family_dir(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    """A tiny checkpoint of the family, made by transformers from its own config, with random biases and
    norm gains (the zero biases and unit gains it initialises would hide a misplaced one)."""
    family = request.param
    config = _hf_config(family)
    if "attention_bias" in config.to_dict():  # Llama's and Qwen3's; Qwen2's q/k/v always have one
        config.attention_bias = True
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    return tmp_path


def test_every_family_satisfies_the_interface(family_dir: Path) -> None:
    cfg = load_model_config(family_dir)
    model = build_model(cfg, 64, get_attention_backend("torch"), torch.float32, torch.device("cpu"))
    assert isinstance(model, CausalLM) and type(model) is family_of(cfg)
    assert model.num_layers == cfg.num_layers and model.dtype == torch.float32
    assert model.attention_shape == AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
    assert len(model.weight_map.shard_sizes("qkv_proj")) == 3  # q, k, v: fused at load or in the checkpoint


def test_every_family_matches_transformers_through_the_forward_and_the_pieces(family_dir: Path) -> None:
    """Prefill and decodes through the runner's forward, then through the piecewise graphs' pieces (run
    eagerly), against transformers' logits."""
    # Eager attention: transformers' SDPA path leaves out Gemma 2's score soft-cap.
    hf = AutoModelForCausalLM.from_pretrained(family_dir, dtype=torch.float32, attn_implementation="eager")
    hf = hf.eval()
    for piecewise in (False, True):
        runner = make_runner(family_dir, max_num_seqs=4)
        if piecewise:
            runner.mixed_graphs = MixedGraphs(
                runner.model, runner.kv.layers, 32, runner.device, bucket_step=16, capture=False
            )
        driver = Driver(runner, seed=2)
        rng = random.Random(2)
        driver.add(0, _random_prompt(rng, 11, runner.vocab_size))
        driver.add(1, _random_prompt(rng, 5, runner.vocab_size))
        driver.step({0: 11, 1: 5})
        for _ in range(3):
            driver.step({0: 1, 1: 1})
        if piecewise:  # every step fits the largest size: none ran the model's own forward
            assert runner.mixed_graphs.num_runs == 4
        _assert_logits_match_hf(driver, hf, dict(driver.tokens))


def test_the_model_code_does_not_import_the_loader() -> None:
    """The loader finds families through the registry; the model code must not import it back (a loop)."""
    code = "import sys, pagedserve.worker.models.registry; print('pagedserve.worker.loader' in sys.modules)"
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.strip() == "False", result.stderr
