"""Mixtral: Mistral's attention with every layer's MLP a mixture of experts (worker/models/moe.py): softmax
over the experts, the top-k (2 of 8) renormalised to sum to 1.

The checkpoint keeps the experts apart, `block_sparse_moe.experts.<e>.w1` (gate), `w3` (up) and `w2`
(down), and the router as `block_sparse_moe.gate`; the loader stacks the experts and maps `block_sparse_moe`
to the layer's `mlp`.
"""

from __future__ import annotations

from typing import Any

import torch

from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.interface import WeightMap, uniform_windows
from pagedserve.worker.models.llama import LLAMA_WEIGHTS, LlamaDecoderLayer
from pagedserve.worker.models.mistral import MistralForCausalLM
from pagedserve.worker.models.moe import moe_decoder_layer

MIXTRAL_WEIGHTS = WeightMap(
    prefix=LLAMA_WEIGHTS.prefix,
    fused=LLAMA_WEIGHTS.fused,
    column_parallel=LLAMA_WEIGHTS.column_parallel,
    row_parallel={**LLAMA_WEIGHTS.row_parallel, "w2": "moe_intermediate_size"},
    embedding=LLAMA_WEIGHTS.embedding,
    lm_head=LLAMA_WEIGHTS.lm_head,
    skipped=LLAMA_WEIGHTS.skipped,
    experts={"w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", 0)},
    renamed={"block_sparse_moe": "mlp"},
)


class MixtralForCausalLM(MistralForCausalLM):
    """A Mixtral causal LM (a Mistral whose every MLP is a SparseMoE); Mistral's sliding-window rule."""

    architectures = ("MixtralForCausalLM",)
    model_types = ("mixtral",)
    weight_map = MIXTRAL_WEIGHTS

    @classmethod
    def config_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        return {
            "qkv_bias": False,
            "o_proj_bias": False,
            "qk_norm": False,
            "num_experts": int(raw["num_local_experts"]),
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["intermediate_size"]),  # every MLP is the experts'
            "norm_topk_prob": True,
            **uniform_windows(raw, cls.sliding_window(raw)),
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
            i, config, backend, dtype, device, self.parallel, fused_ops, round_weights=False
        )
