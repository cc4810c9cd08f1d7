"""Reads a local Hugging Face Llama checkpoint: its config, and its weights into the worker's own modules.

config.json is read as plain JSON rather than through transformers, so the worker does not depend on how a
given transformers version normalises it; both the old (`rope_theta` + `rope_scaling`) and the new
(`rope_parameters`) layouts are understood.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Parameters of a RoPE frequency scaling; fields unused by a type keep their defaults."""

    rope_type: str  # "linear" or "llama3"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 0


@dataclass(frozen=True)
class ModelConfig:
    """The shape and constants of a Llama model, as the worker needs them."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _as_id_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_settings(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes `rope_parameters` (theta included); older ones `rope_theta` and `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 0))
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(params["factor"]),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original),
    )


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The ModelConfig of the checkpoint in `model_dir` (config.json, and generation_config.json for EOS)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: not a Hugging Face checkpoint directory")
    raw = _read_json(config_path)
    if raw.get("model_type", "llama") != "llama":
        raise ValueError(f"only Llama checkpoints are supported, got model_type {raw.get('model_type')!r}")
    theta, scaling = _rope_settings(raw)
    eos = ()
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = _as_id_list(_read_json(gen_path).get("eos_token_id"))
    if not eos:
        eos = _as_id_list(raw.get("eos_token_id"))
    num_heads = int(raw["num_attention_heads"])
    return ModelConfig(
        hidden_size=int(raw["hidden_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
        head_dim=int(raw.get("head_dim") or raw["hidden_size"] // num_heads),
        intermediate_size=int(raw["intermediate_size"]),
        vocab_size=int(raw["vocab_size"]),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
        eos_token_ids=eos,
    )


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        return [model_dir / s for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    return files


def iter_checkpoint_tensors(
    model_dir: str | Path, device: torch.device
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (name, tensor) of the checkpoint, read one at a time straight onto `device`."""
    for path in _checkpoint_files(Path(model_dir)):
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


# Checkpoint projections that the worker stores fused: (fused parameter, index of the shard within it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def _fused_target(name: str) -> tuple[str, int] | None:
    """('...qkv_proj.weight', shard) for a q/k/v or gate/up checkpoint name, else None."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard
    return None


def _shard_rows(config: ModelConfig, fused_name: str, shard: int) -> tuple[int, int]:
    if "qkv_proj" in fused_name:
        sizes = [config.q_size, config.kv_size, config.kv_size]
    else:
        sizes = [config.intermediate_size, config.intermediate_size]
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


def load_weights(model: torch.nn.Module, config: ModelConfig, model_dir: str | Path) -> None:
    """Copies the checkpoint's tensors into `model` (whose parameters are already on the target device and
    dtype), fusing q/k/v and gate/up, and tying lm_head to the embedding where the checkpoint says so."""
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    loaded: set[str] = set()
    for ckpt_name, tensor in iter_checkpoint_tensors(model_dir, device):
        name = ckpt_name.removeprefix("model.")
        if "rotary_emb" in name:  # older checkpoints store inv_freq; the worker computes its own
            continue
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        fused = _fused_target(name)
        if fused is not None:
            target_name, shard = fused
            start, end = _shard_rows(config, target_name, shard)
            target = params[target_name][start:end]
            loaded.add(f"{target_name}#{shard}")
        elif name in params:
            target = params[name]
            loaded.add(name)
        else:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in the model")
        if target.shape != tensor.shape:
            shapes = f"checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}"
            raise ValueError(f"{ckpt_name}: shape mismatch: {shapes}")
        with torch.no_grad():
            target.copy_(tensor)

    if "lm_head.weight" not in loaded:
        # Tied, or a checkpoint that simply has no lm_head: the output projection is the embedding.
        model.lm_head.weight = model.embed_tokens.weight
        loaded.add("lm_head.weight")
    expected = set()
    for name in params:
        if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
            expected.update(f"{name}#{i}" for i in range(3))
        elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
            expected.update(f"{name}#{i}" for i in range(2))
        else:
            expected.add(name)
    missing = sorted(expected - loaded)
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks {len(missing)} tensors, e.g. {missing[:5]}")
