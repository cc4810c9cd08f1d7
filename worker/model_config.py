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

from pagedserve.common.config import WorkerConfig
from pagedserve.worker.models.quantization import QuantConfig

DEFAULT_ROPE_THETA = 10000.0
DEFAULT_MAX_POSITION_EMBEDDINGS = 2048  # the loader's default too (LlamaConfig's)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


@dataclass(frozen=True)
class RopeScaling:
    """Parameters of a RoPE frequency scaling; fields unused by a type keep their defaults. The math is
    worker/models/rotary.py's."""

    rope_type: str  # "linear", "llama3", "yarn", "dynamic" or "longrope"
    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    # llama3, yarn, longrope: the pretraining length; dynamic: config.json's max_position_embeddings, past
    # which transformers starts to scale
    original_max_position_embeddings: int = 0
    attention_factor: float | None = None  # yarn, longrope: multiplies cos/sin; None: derived from factor
    beta_fast: float = 32.0  # yarn: the ramp between extrapolated and interpolated frequencies
    beta_slow: float = 1.0
    mscale: float | None = None  # yarn (DeepSeek's form of the attention factor)
    mscale_all_dim: float | None = None
    truncate: bool = True  # yarn: the ramp's bounds rounded to whole dimensions
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors, up to the original length
    long_factor: tuple[float, ...] = ()  # longrope: past it


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
    max_position_embeddings: int  # capped to the sliding window where the family leaves windows out
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    qk_norm: bool  # RMSNorm over head_dim on each q and k head, before RoPE (Qwen3)
    mlp_bias: bool
    eos_token_ids: tuple[int, ...]
    partial_rotary_factor: float = 1.0  # RoPE rotates this part of each head's dimensions (Phi-4-mini: 0.75)
    # FP8 linear weights (worker/models/quantization.py): the checkpoint's quantization_config, or
    # --quantization fp8 (quantized at load); None: the weights as they are
    quantization: QuantConfig | None = None
    # Gemma 2 / 3 (worker/models/gemma2.py, gemma3.py); the defaults are every other family's.
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window, 0 = global; () = all global
    attn_logit_softcap: float = 0.0  # scores soft-capped to (-c, c) before the softmax; 0 = off
    final_logit_softcap: float = 0.0  # logits soft-capped likewise; 0 = off
    query_pre_attn_scalar: float = 0.0  # scores scaled by its -1/2 power; 0 = head_dim's
    sliding_rope_theta: float = 0.0  # RoPE base of the sliding layers (Gemma 3); 0 = rope_theta
    hidden_activation: str = "silu"  # the gated MLP's activation: "silu", or config.json's GELU name (Gemma)
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
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

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
    """RoPE's theta and scaling from a raw config.json, read as transformers reads them
    (`RotaryEmbeddingConfigMixin.standardize_rope_params` and the `_compute_*_parameters` functions)."""
    # transformers 5 writes `rope_parameters` (theta included); older ones `rope_theta` and `rope_scaling`.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", DEFAULT_ROPE_THETA)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    # Phi-3 checkpoints name longrope "su" at first (transformers reads their "yarn" as longrope too).
    if rope_type == "su" or (rope_type == "yarn" and raw.get("model_type") == "phi3"):
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    max_positions = int(raw.get("max_position_embeddings", DEFAULT_MAX_POSITION_EMBEDDINGS))
    if rope_type == "dynamic":  # transformers scales past config.max_position_embeddings, whatever is set
        original = max_positions
    else:  # a top-level original_max_position_embeddings (Phi-3's) wins over the one in the rope parameters
        original = int(
            raw.get("original_max_position_embeddings")
            or params.get("original_max_position_embeddings")
            or max_positions
        )
    factor = params.get("factor")
    if factor is None:  # yarn and longrope: the ratio of the extended length to the pretraining one
        if rope_type not in ("yarn", "longrope"):
            raise ValueError(f"rope_type {rope_type!r} needs a factor")
        factor = max_positions / original
    attention_factor = params.get("attention_factor")
    return theta, RopeScaling(
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        attention_factor=None if attention_factor is None else float(attention_factor),
        beta_fast=float(params.get("beta_fast") or 32.0),  # transformers: `or 32`, a 0 too
        beta_slow=float(params.get("beta_slow") or 1.0),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        truncate=bool(params.get("truncate", True)),
        short_factor=tuple(float(f) for f in params.get("short_factor") or ()),
        long_factor=tuple(float(f) for f in params.get("long_factor") or ()),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def rope_max_positions(max_position_embeddings: int, scaling: RopeScaling | None) -> int:
    """The longest context a checkpoint is made for: config.json's max_position_embeddings, or past it what
    the RoPE scaling extends to (vLLM's rule): YaRN's pretraining length times its factor, dynamic NTK's
    max_position_embeddings times its factor. Linear, llama3 and longrope configs state the extended length
    in max_position_embeddings already."""
    if scaling is None:
        return max_position_embeddings
    if scaling.rope_type == "yarn":
        return max(max_position_embeddings, int(scaling.original_max_position_embeddings * scaling.factor))
    if scaling.rope_type == "dynamic":
        return max(max_position_embeddings, int(max_position_embeddings * scaling.factor))
    return max_position_embeddings


def resolve_max_model_len(cfg: WorkerConfig, model_cfg: ModelConfig) -> int:
    """The configured max_model_len, or the model's own limit; never past the model's limit."""
    limit = model_cfg.max_position_embeddings
    if cfg.max_model_len > limit:
        raise ValueError(
            f"max_model_len {cfg.max_model_len} exceeds the model's max_position_embeddings {limit}"
        )
    return cfg.max_model_len or limit
