"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (biased q/k/v) with mixture-of-experts MLPs
(worker/models/moe.py) that add a shared expert, every token's, scaled by sigmoid(shared_expert_gate(x)).
The routing and the dense layers follow Qwen3-MoE's rules (worker/models/qwen3_moe.py).

The checkpoint's shared expert, `mlp.shared_expert.gate_proj` / `up_proj` / `down_proj`, is the MoE block's
`shared_gate_up_proj` (fused) and `shared_down_proj`: projections of a size of their own
(shared_expert_intermediate_size), which tensor parallelism splits as the dense MLP's.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.interface import WeightMap
from pagedserve.worker.models.llama import LlamaDecoderLayer
from pagedserve.worker.models.moe import moe_decoder_layer
from pagedserve.worker.models.qwen2 import Qwen2ForCausalLM, qwen_layer_windows
from pagedserve.worker.models.qwen3_moe import QWEN_MOE_WEIGHTS, qwen_moe_fields

QWEN2_MOE_WEIGHTS = WeightMap(
    prefix=QWEN_MOE_WEIGHTS.prefix,
    fused={
        **QWEN_MOE_WEIGHTS.fused,
        "shared_gate_proj": ("shared_gate_up_proj", 0),
        "shared_up_proj": ("shared_gate_up_proj", 1),
    },
    column_parallel={
        **QWEN_MOE_WEIGHTS.column_parallel,
        "shared_gate_proj": "shared_expert_intermediate_size",
        "shared_up_proj": "shared_expert_intermediate_size",
    },
    row_parallel={**QWEN_MOE_WEIGHTS.row_parallel, "shared_down_proj": "shared_expert_intermediate_size"},
    embedding=QWEN_MOE_WEIGHTS.embedding,
    lm_head=QWEN_MOE_WEIGHTS.lm_head,
    skipped=QWEN_MOE_WEIGHTS.skipped,
    experts=QWEN_MOE_WEIGHTS.experts,
    renamed={
        "shared_expert.gate_proj": "shared_gate_proj",
        "shared_expert.up_proj": "shared_up_proj",
        "shared_expert.down_proj": "shared_down_proj",
    },
)


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """A Qwen2-MoE causal LM: Qwen2's layers, with a SparseMoE MLP (and its shared expert) in the sparse
    ones."""

    architectures = ("Qwen2MoeForCausalLM",)
    model_types = ("qwen2_moe",)
    weight_map = QWEN2_MOE_WEIGHTS

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {
            "qkv_bias": bool(raw.get("qkv_bias", True)),
            "o_proj_bias": False,
            "qk_norm": False,
            "layer_windows": qwen_layer_windows(raw),
            **qwen_moe_fields(raw),
            "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
        }

    def make_layer(
        self,
        i: int,
        config: ModelConfig,
        backend: AttentionBackend,
        dtype: torch.dtype,
        device: torch.device,
        fused_ops: bool,
    ) -> LlamaDecoderLayer:
        return moe_decoder_layer(
            i, config, backend, dtype, device, self.parallel, fused_ops, round_weights=True
        )
