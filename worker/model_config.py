"""The shape and constants of a Llama-like model (Llama, Mistral, Qwen2, Qwen3), read from a local Hugging
Face checkpoint's config.json.

config.json is read as plain JSON rather than through transformers, so the worker does not depend on how a
given transformers version normalises it; both the old (`rope_theta` + `rope_scaling`) and the new
(`rope_parameters`) layouts are understood.

The four families share one forward and differ only in flags: Qwen2 always has a bias on q/k/v and none on
o_proj (its config has no `attention_bias`); Qwen3 normalises each q and k head before RoPE (`q_norm`,
`k_norm`). The worker has no sliding-window attention; within the window a sliding layer attends exactly as a
full one does, so a checkpoint whose layers slide (Mistral v0.1's `sliding_window`, Qwen's
`use_sliding_window`) is served with max_position_embeddings capped to the window.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import WorkerConfig

DEFAULT_ROPE_THETA = 10000.0
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


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
    """The shape and constants of a Llama-like model, as the worker needs them."""

    model_type: str  # one of SUPPORTED_MODEL_TYPES
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
    max_position_embeddings: int  # capped to the sliding window, if any layer has one
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool  # RMSNorm over head_dim on each q and k head, before RoPE (Qwen3)
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


def _sliding_window(raw: dict[str, Any], model_type: str) -> int | None:
    """The attention window of the checkpoint's sliding layers, or None when every layer sees all tokens."""
    if model_type == "mistral":
        window = raw.get("sliding_window")  # null from Mistral v0.2 on; 4096 in v0.1, for every layer
        return int(window) if window else None
    if (
        model_type not in ("qwen2", "qwen3")
        or not raw.get("use_sliding_window")
        or not raw.get("sliding_window")
    ):
        return None
    # Qwen slides only in layers from max_window_layers on; transformers 5 also writes them as layer_types.
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        slides = "sliding_attention" in layer_types
    else:
        slides = int(raw.get("max_window_layers", 0)) < int(raw["num_hidden_layers"])
    return int(raw["sliding_window"]) if slides else None


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The ModelConfig of the checkpoint in `model_dir` (config.json, and generation_config.json for EOS)."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"no config.json in {model_dir}: not a Hugging Face checkpoint directory")
    raw = _read_json(config_path)
    model_type = raw.get("model_type", "llama")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported model_type {model_type!r} in {config_path}; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    theta, scaling = _rope_settings(raw)
    eos = ()
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        eos = _as_id_list(_read_json(gen_path).get("eos_token_id"))
    if not eos:
        eos = _as_id_list(raw.get("eos_token_id"))
    num_heads = int(raw["num_attention_heads"])
    if model_type == "qwen2":  # its config has no attention_bias: q/k/v always have a bias, o_proj never
        qkv_bias, o_proj_bias = True, False
    else:
        qkv_bias = o_proj_bias = bool(raw.get("attention_bias", False))
    max_position_embeddings = int(raw.get("max_position_embeddings", 2048))
    window = _sliding_window(raw, model_type)
    if window is not None:
        max_position_embeddings = min(max_position_embeddings, window)
    return ModelConfig(
        model_type=model_type,
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
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_proj_bias=o_proj_bias,
        qk_norm=model_type == "qwen3",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        eos_token_ids=eos,
    )


def resolve_max_model_len(cfg: WorkerConfig, model_cfg: ModelConfig) -> int:
    """The configured max_model_len, or the model's own limit; never past the model's limit."""
    limit = model_cfg.max_position_embeddings
    if cfg.max_model_len > limit:
        raise ValueError(
            f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings {limit}"
        )
    return cfg.max_model_len or limit
