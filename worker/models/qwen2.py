"""Qwen2: Llama's layers with a bias on the q/k/v projections (never on o_proj: its config has no
`attention_bias`), and sliding windows in the upper layers when `use_sliding_window` is set."""

from __future__ import annotations

from typing import Any

from worker.models.llama import LlamaForCausalLM


def qwen_sliding_window(raw: dict[str, Any]) -> int | None:
    """Qwen2's and Qwen3's window: only with `use_sliding_window`, and only if some layer slides."""
    if not raw.get("use_sliding_window") or not raw.get("sliding_window"):
        return None
    # Qwen slides only in layers from max_window_layers on; transformers 5 also writes them as layer_types.
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        slides = "sliding_attention" in layer_types
    else:
        slides = int(raw.get("max_window_layers", 0)) < int(raw["num_hidden_layers"])
    return int(raw["sliding_window"]) if slides else None


class Qwen2ForCausalLM(LlamaForCausalLM):
    """A Qwen2 (and Qwen2.5) causal LM."""

    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {"qkv_bias": True, "o_proj_bias": False, "qk_norm": False}

    @classmethod
    def sliding_window(cls, raw: dict[str, Any]) -> int | None:
        return qwen_sliding_window(raw)
