"""The shape and constants of a model as the worker needs them (`ModelConfig`), and the pieces of config.json
that every family reads alike. worker/loader.py `load_model_config` reads a checkpoint's config with them and
with its family's own quirks (worker/models/: biases, q/k norms, sliding windows).

config.json is read as plain JSON rather than through transformers, so the worker does not depend on how a
given transformers version normalises it; both the old (`rope_theta` + `rope_scaling`) and the new
(`rope_parameters`) layouts are understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import WorkerConfig

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
    """The shape and constants of a Llama-like model, as the worker needs them."""

    model_type: str  # one of worker/models/registry.py BY_MODEL_TYPE
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
    # Mixture of experts (worker/models/moe.py); 0 experts: every layer's MLP is dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each expert's; intermediate_size stays the dense layers'
    norm_topk_prob: bool = True  # the top-k routing weights renormalised to sum to 1
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP in a MoE model (Qwen3-MoE mlp_only_layers)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's shared expert, beside the routed ones (0: none)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def as_id_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_settings(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
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


def resolve_max_model_len(cfg: WorkerConfig, model_cfg: ModelConfig) -> int:
    """The configured max_model_len, or the model's own limit; never past the model's limit."""
    limit = model_cfg.max_position_embeddings
    if cfg.max_model_len > limit:
        raise ValueError(
            f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings {limit}"
        )
    return cfg.max_model_len or limit
