"""Qwen2: Llama's layers with a bias on the q/k/v projections (never on o_proj: its config has no
`attention_bias`), and sliding windows in the upper layers when `use_sliding_window` is set."""

from __future__ import annotations

from typing import Any

from pagedserve.worker.models.llama import LlamaForCausalLM


def qwen_sliding_window(raw: dict[str, Any]) -> int | None:
    """Qwen2's and Qwen3's window: only with `use_sliding_window`, and only if some layer slides."""
    return int(raw["sliding_window"]) if any(qwen_layer_windows(raw)) else None


def qwen_layer_windows(raw: dict[str, Any]) -> tuple[int, ...]:
    """Each layer's window (0: global) as transformers' Qwen2/Qwen3 configs choose them; () if none slides."""
    if not raw.get("use_sliding_window") or not raw.get("sliding_window"):
        return ()
    num_layers = int(raw["num_hidden_layers"])
    # Qwen slides only in layers from max_window_layers on; transformers 5 also writes them as layer_types.
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        slides = [t == "sliding_attention" for t in layer_types]
    else:
        slides = [i >= int(raw.get("max_window_layers", 0)) for i in range(num_layers)]
    windows = tuple(int(raw["sliding_window"]) if s else 0 for s in slides)
    return windows if any(windows) else ()


class Qwen2ForCausalLM(LlamaForCausalLM):
    """A Qwen2 (and Qwen2.5) causal LM."""

    architectures = ("Qwen2ForCausalLM",)
    model_types = ("qwen2",)

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        windows = qwen_layer_windows(raw)
        return {"qkv_bias": True, "o_proj_bias": False, "qk_norm": False, "layer_windows": windows}

    @classmethod
    def sliding_window(cls, raw: dict[str, Any]) -> int | None:
        return qwen_sliding_window(raw)
