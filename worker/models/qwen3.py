"""Qwen3: Llama's layers with an RMSNorm over each q and k head before RoPE (one weight over head_dim, shared
by the heads), a head_dim of its own (not hidden_size / num_heads), and Qwen2's sliding-window rule."""

from __future__ import annotations

from typing import Any

from pagedserve.worker.models.llama import LlamaForCausalLM
from pagedserve.worker.models.qwen2 import qwen_layer_windows, qwen_sliding_window


class Qwen3ForCausalLM(LlamaForCausalLM):
    """A Qwen3 (dense) causal LM."""

    architectures = ("Qwen3ForCausalLM",)
    model_types = ("qwen3",)

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        bias = bool(raw.get("attention_bias", False))
        windows = qwen_layer_windows(raw)
        return {"qkv_bias": bias, "o_proj_bias": bias, "qk_norm": True, "layer_windows": windows}

    @classmethod
    def sliding_window(cls, raw: dict[str, Any]) -> int | None:
        return qwen_sliding_window(raw)
