"""Qwen3-MoE: Qwen3's attention (q/k norms, its own head_dim) with mixture-of-experts MLPs
(worker/models/moe.py): softmax over the experts, the top-k (8 of 128 in Qwen3-30B-A3B), renormalised only
with `norm_topk_prob`, the routing weights rounded to the model dtype. Layers listed in `mlp_only_layers`,
and all but every `decoder_sparse_step`-th, keep a dense MLP of `intermediate_size`.

The checkpoint keeps the experts apart, `mlp.experts.<e>.gate_proj` / `up_proj` / `down_proj`, beside the
router `mlp.gate`; the loader stacks the experts.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.interface import WeightMap
from pagedserve.worker.models.llama import LLAMA_WEIGHTS, LlamaDecoderLayer
from pagedserve.worker.models.moe import moe_decoder_layer
from pagedserve.worker.models.qwen3 import Qwen3ForCausalLM

QWEN_MOE_WEIGHTS = WeightMap(
    prefix=LLAMA_WEIGHTS.prefix,
    fused=LLAMA_WEIGHTS.fused,
    column_parallel=LLAMA_WEIGHTS.column_parallel,
    row_parallel=LLAMA_WEIGHTS.row_parallel,  # down_proj: the dense layers' and, split likewise, the experts'
    embedding=LLAMA_WEIGHTS.embedding,
    lm_head=LLAMA_WEIGHTS.lm_head,
    skipped=LLAMA_WEIGHTS.skipped,
    experts={"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)},
)


def qwen_moe_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of a Qwen-MoE config.json (transformers 5 writes num_experts as num_local_experts)."""
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    step = int(raw.get("decoder_sparse_step", 1))
    mlp_only = set(raw.get("mlp_only_layers") or ())
    num_layers = int(raw["num_hidden_layers"])
    sparse = [i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers)]
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": int(raw["num_experts_per_tok"]),
        "moe_intermediate_size": int(raw["moe_intermediate_size"]),
        "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
        "dense_layers": tuple(i for i in range(num_layers) if not sparse[i]),
    }


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """A Qwen3-MoE causal LM: Qwen3's layers, with a SparseMoE MLP in the sparse ones."""

    architectures = ("Qwen3MoeForCausalLM",)
    model_types = ("qwen3_moe",)
    weight_map = QWEN_MOE_WEIGHTS

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {**super().config_fields(raw), **qwen_moe_fields(raw)}

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
