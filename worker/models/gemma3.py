"""Gemma 3 (text): Gemma 2's layers (worker/models/gemma2.py) with q/k norms ((1 + w) RMSNorms over each
head, before RoPE), five sliding layers to each global one (`sliding_window_pattern` 6, or `layer_types`),
no attention soft-cap (the config may still name one; it is applied), and its own RoPE for the sliding
layers: base `rope_local_base_freq` (10k) and no scaling, while the global layers take `rope_theta` (1M) and
`rope_scaling` (linear x8 in the 4B-27B models). transformers 5 writes both as `rope_parameters` keyed by
layer type ("full_attention", "sliding_attention"); older configs the flat keys. Both are read here.

This is transformers' Gemma3ForCausalLM (model_type "gemma3_text"); the multimodal
Gemma3ForConditionalGeneration (model_type "gemma3", weights under `language_model.`) is not served.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from pagedserve.worker.model_config import DEFAULT_ROPE_THETA, ModelConfig, rope_settings
from pagedserve.worker.models.gemma2 import Gemma2ForCausalLM, gemma_config_fields
from pagedserve.worker.models.layers import RotaryEmbedding

GEMMA3_LOCAL_ROPE_THETA = 10000.0  # transformers' default rope_local_base_freq


def gemma3_rope(raw: dict[str, Any]) -> dict[str, Any]:
    """rope_theta and rope_scaling of the global layers and sliding_rope_theta, from either layout."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = params["full_attention"]
        sliding = params.get("sliding_attention") or {}
        theta, scaling = rope_settings(
            {"rope_parameters": full, "max_position_embeddings": raw.get("max_position_embeddings", 0)}
        )
        if "rope_theta" not in full:
            theta = float(raw.get("rope_theta", 1_000_000.0))
        local = float(sliding.get("rope_theta", raw.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA)))
        if sliding.get("rope_type", "default") != "default":
            raise ValueError(f"unsupported rope_type {sliding['rope_type']!r} for Gemma 3's sliding layers")
    else:
        theta, scaling = rope_settings(raw)
        if "rope_theta" not in raw and "rope_theta" not in (params or {}):
            theta = 1_000_000.0  # Gemma3TextConfig's default, not Llama's
        local = float(raw.get("rope_local_base_freq", GEMMA3_LOCAL_ROPE_THETA))
    return {"rope_theta": theta or DEFAULT_ROPE_THETA, "rope_scaling": scaling, "sliding_rope_theta": local}


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """A Gemma 3 text causal LM."""

    architectures = ("Gemma3ForCausalLM",)
    model_types = ("gemma3_text",)
    sliding_window_pattern = 6

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**gemma_config_fields(raw, cls.sliding_window_pattern), "qk_norm": True, **gemma3_rope(raw)}

    def _layer_ropes(
        self, config: ModelConfig, max_model_len: int, dtype: torch.dtype, device: torch.device, fused: bool
    ) -> tuple[RotaryEmbedding, ...]:
        """The global layers' RoPE is `rotary_emb`; the sliding layers' has its own base and no scaling."""
        local_config = replace(
            config, rope_theta=config.sliding_rope_theta or config.rope_theta, rope_scaling=None
        )
        self.rotary_emb_local = RotaryEmbedding(local_config, max_model_len, dtype, device, fused)
        windows = config.layer_windows or (0,) * config.num_layers
        return tuple(self.rotary_emb_local if w else self.rotary_emb for w in windows)
