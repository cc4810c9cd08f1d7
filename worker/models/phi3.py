"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's layers (no biases, SwiGLU), with q/k/v and gate/up stored
fused in the checkpoint (`qkv_proj`, `gate_up_proj`: the worker's own layout, so they load as they are and
tensor parallelism splits them part by part), longrope scaling for the long-context checkpoints
(Phi-3-mini-128k, Phi-3.5, Phi-4-mini; worker/models/rotary.py), a partial rotary factor (Phi-4-mini rotates
3/4 of each head), and a sliding window over every layer where config.json names one.
"""

from __future__ import annotations

from typing import Any

from pagedserve.worker.models.interface import WeightMap, uniform_windows
from pagedserve.worker.models.llama import LlamaForCausalLM

PHI3_WEIGHTS = WeightMap(
    prefix="model.",
    fused={},
    column_parallel={},
    row_parallel={"o_proj": "q_size", "down_proj": "intermediate_size"},
    embedding="embed_tokens.weight",
    lm_head="lm_head.weight",
    skipped=("rotary_emb",),
    packed={
        "qkv_proj": ("q_size", "kv_size", "kv_size"),
        "gate_up_proj": ("intermediate_size", "intermediate_size"),  # gate, then up: GatedMLP's order
    },
)


class Phi3ForCausalLM(LlamaForCausalLM):
    """A Phi-3 (mini, medium, 3.5-mini) or Phi-4 (14B, mini) causal LM."""

    architectures = ("Phi3ForCausalLM",)
    model_types = ("phi3",)
    weight_map = PHI3_WEIGHTS

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        activation = raw.get("hidden_act", "silu")
        if activation != "silu":
            raise ValueError(f"Phi-3 with hidden_act {activation!r} is not supported (only silu)")
        # transformers' Phi3Config keeps the factor in the rope parameters, from the top level if it is there.
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        return {
            "qkv_bias": False,
            "o_proj_bias": False,
            "qk_norm": False,
            "partial_rotary_factor": float(partial),
            **uniform_windows(raw, cls.sliding_window(raw)),
        }

    @classmethod
    def sliding_window(cls, raw: dict[str, Any]) -> int | None:
        window = raw.get("sliding_window")  # every layer (transformers' Phi3Model); Phi-3-mini-4k: 2047
        return int(window) if window else None
