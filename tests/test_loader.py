"""Checkpoint reading: config layouts and model types, EOS ids, and the weights of sharded / tied / biased
checkpoints."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import NewSequence, SamplingParams, StepPlan
from pagedserve.worker.loader import load_model_config
from pagedserve.worker.model_config import RopeScaling
from pagedserve.worker.model_runner import ModelRunner
from pagedserve.worker.models.layers import rope_inv_freq


def _write_config(path: Path, config: dict, generation: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (path / "generation_config.json").write_text(json.dumps(generation))
    return path


BASE = {
    "model_type": "llama",
    "hidden_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "intermediate_size": 512,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
}


def test_old_config_layout_with_linear_scaling_and_derived_head_dim(tmp_path: Path) -> None:
    raw = {
        **BASE,
        "rope_theta": 20000.0,
        "rope_scaling": {"type": "linear", "factor": 2.0},
        "eos_token_id": 5,
    }
    cfg = load_model_config(_write_config(tmp_path, raw))
    assert cfg.head_dim == 32 and cfg.num_kv_heads == 8  # derived: hidden / heads, and no GQA
    assert cfg.rope_theta == 20000.0
    assert cfg.rope_scaling == RopeScaling("linear", 2.0, original_max_position_embeddings=4096)
    assert cfg.eos_token_ids == (5,)


def test_new_config_layout_with_llama3_scaling_and_generation_eos(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 1024,
    }
    raw = {**BASE, "rope_parameters": rope, "head_dim": 64, "num_key_value_heads": 2, "eos_token_id": 5}
    cfg = load_model_config(_write_config(tmp_path, raw, {"eos_token_id": [7, 9]}))
    assert cfg.head_dim == 64 and cfg.num_kv_heads == 2
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 1024)
    assert cfg.eos_token_ids == (7, 9)  # generation_config wins over config


def test_unsupported_rope_type_is_refused(tmp_path: Path) -> None:
    raw = {**BASE, "rope_scaling": {"rope_type": "proportional", "factor": 4.0}}
    with pytest.raises(ValueError, match="proportional"):
        load_model_config(_write_config(tmp_path, raw))


@pytest.mark.parametrize("rope_type", ["default", "linear", "llama3"])
def test_rope_inv_freq_matches_transformers(rope_type: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": rope_type, "rope_theta": 500000.0}
    if rope_type != "default":
        rope.update(
            factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=512
        )
    hf_config = LlamaConfig(**{**BASE, "head_dim": 64, "rope_parameters": rope})
    if rope_type == "default":
        expected = 1.0 / (500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    scaling = None if rope_type == "default" else RopeScaling(rope_type, 8.0, 1.0, 4.0, 512)
    torch.testing.assert_close(rope_inv_freq(64, 500000.0, scaling), expected)


def test_sharded_tied_biased_checkpoint_matches_transformers(tmp_path: Path) -> None:
    config = LlamaConfig(
        **{**BASE, "vocab_size": 500, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 160},
        num_key_value_heads=1,
        tie_word_embeddings=True,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        initializer_range=0.1,
    )
    torch.manual_seed(0)
    hf = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias") or name.endswith("norm.weight"):
                p.uniform_(-0.5, 1.5)  # the default zero biases and unit norms would hide a loading bug
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()

    runner = ModelRunner(WorkerConfig(model=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=8))
    assert runner.model.lm_head.weight is runner.model.embed_tokens.weight
    rows: list[torch.Tensor] = []
    compute_logits = runner.model.compute_logits
    runner.model.compute_logits = lambda h: rows.append(compute_logits(h)) or rows[-1]
    prompt = [random.Random(0).randrange(500) for _ in range(21)]
    runner.execute(
        StepPlan(
            0, [], [NewSequence(0, prompt, [5, 2], 0, SamplingParams(temperature=0.0), 0)], [], [0], [21], [0]
        )
    )
    with torch.no_grad():
        expected = hf(torch.tensor([prompt])).logits[0, -1]
    assert (rows[0][0] - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize(
    "model_type,extra,flags",
    [
        ("llama", {"attention_bias": True}, (True, True, False)),
        ("mistral", {}, (False, False, False)),
        ("qwen2", {}, (True, False, False)),  # Qwen2's config has no attention_bias: q/k/v biased, o_proj not
        ("qwen3", {"attention_bias": False}, (False, False, True)),
        ("qwen3", {"attention_bias": True}, (True, True, True)),
    ],
)
def test_architecture_flags_per_model_type(
    tmp_path: Path, model_type: str, extra: dict, flags: tuple[bool, bool, bool]
) -> None:
    cfg = load_model_config(_write_config(tmp_path, {**BASE, "model_type": model_type, **extra}))
    assert cfg.model_type == model_type
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.qk_norm) == flags


def test_qwen3_head_dim_comes_from_config(tmp_path: Path) -> None:
    raw = {
        **BASE,
        "model_type": "qwen3",
        "head_dim": 128,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
    cfg = load_model_config(_write_config(tmp_path, raw))
    assert cfg.head_dim == 128 and (cfg.q_size, cfg.kv_size) == (1024, 256)  # q_size != hidden_size (256)
    assert cfg.tie_word_embeddings


def test_unsupported_model_type_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported model_type 'falcon'.*qwen3"):
        load_model_config(_write_config(tmp_path, {**BASE, "model_type": "falcon"}))


@pytest.mark.parametrize(
    "extra,layer_windows",
    [
        ({"model_type": "mistral", "sliding_window": 1024}, (1024, 1024)),  # Mistral v0.1: every layer slides
        ({"model_type": "mistral", "sliding_window": None}, ()),
        ({"model_type": "phi3", "sliding_window": 2047}, (2047, 2047)),  # Phi-3-mini-4k
        ({"model_type": "qwen2", "use_sliding_window": False, "sliding_window": 1024}, ()),
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 1024,
                "max_window_layers": 1,
            },
            (0, 1024),
        ),
        # Layers from max_window_layers on slide: with 2 layers and max_window_layers 2, none does.
        (
            {
                "model_type": "qwen2",
                "use_sliding_window": True,
                "sliding_window": 1024,
                "max_window_layers": 2,
            },
            (),
        ),
        (
            {
                "model_type": "qwen3",
                "use_sliding_window": True,
                "sliding_window": 1024,
                "layer_types": ["full_attention", "sliding_attention"],
            },
            (0, 1024),
        ),
    ],
)
def test_sliding_windows_apply_per_layer_and_keep_the_context(
    tmp_path: Path, extra: dict, layer_windows: tuple[int, ...]
) -> None:
    """Windowed layers attend over their window (tests/test_sliding_windows.py against transformers), so the
    context is the model's whole max_position_embeddings, not the window."""
    cfg = load_model_config(_write_config(tmp_path, {**BASE, **extra}))
    assert cfg.layer_windows == layer_windows
    assert cfg.max_position_embeddings == BASE["max_position_embeddings"]
