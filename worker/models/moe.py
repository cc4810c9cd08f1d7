"""The mixture-of-experts feed-forward block that Mixtral, Qwen3-MoE and Qwen2-MoE share
(worker/models/mixtral.py, qwen3_moe.py, qwen2_moe.py): a router picks each token's top-k experts, and the
experts' SwiGLU outputs are summed with the routing weights. Qwen2-MoE adds a shared expert that every token
goes through, scaled by a sigmoid gate of its own.

The experts' weights are stacked, as transformers holds them in memory: `experts.gate_up_proj` [E, 2I, H]
(each expert's gate rows, then its up rows) and `experts.down_proj` [E, H, I]; the loader stacks the
checkpoint's per-expert tensors into them (WeightMap.experts). Tensor parallelism splits every expert as the
dense MLP is split: each rank holds all E experts with I/N of their gate/up rows and the matching I/N input
columns of down_proj, and the ranks' partial sums are all-reduced once after the weighted sum over the top-k
(the shared expert's partial output, split likewise, is added before it). The router and the shared
expert's gate are whole on every rank, so every rank routes every token alike.

On CUDA the experts run in the Triton kernel (kernels/fused_moe.py), whatever `--fused-ops` says: the PyTorch
reference loops over the experts the batch hit, a host sync that no CUDA graph can hold. On the CPU the
reference runs, or the kernel under TRITON_INTERPRET=1 with fused ops on (the tests).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import reference_moe, reference_ops
from pagedserve.worker.attention import AttentionBackend
from pagedserve.worker.model_config import ModelConfig
from pagedserve.worker.models.layers import param
from pagedserve.worker.models.llama import LlamaDecoderLayer
from pagedserve.worker.parallel import ParallelContext

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _experts_fn(device: torch.device, fused: bool) -> ExpertsFn:
    if device.type == "cuda" or fused:
        from pagedserve.kernels import (
            fused_moe,  # imported on demand: on the CPU without fused ops, no Triton needed
        )

        return fused_moe.fused_moe
    return reference_moe.fused_moe


class SparseMoE(nn.Module):
    """Top-k routed SwiGLU experts. `config` is this rank's shape (moe_intermediate_size per rank).
    `round_weights`: the routing weights are rounded to the model dtype before they scale the experts'
    outputs (Qwen-MoE; Mixtral keeps them in float32)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        parallel: ParallelContext,
        fused: bool,
        round_weights: bool,
    ) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.parallel = parallel
        self.top_k = config.num_experts_per_tok
        self.renormalize = config.norm_topk_prob
        self.round_weights = round_weights
        self.gate = nn.Module()  # the router
        self.gate.weight = param(experts, hidden, **kw)
        self.experts = nn.Module()
        self.experts.gate_up_proj = param(experts, 2 * inter, hidden, **kw)
        self.experts.down_proj = param(experts, hidden, inter, **kw)
        self._experts = _experts_fn(device, fused)
        shared = config.shared_expert_intermediate_size
        self.shared_gate_up_proj: nn.Module | None = None
        if shared:  # Qwen2-MoE
            self.shared_gate_up_proj = nn.Module()
            self.shared_gate_up_proj.weight = param(2 * shared, hidden, **kw)
            self.shared_down_proj = nn.Module()
            self.shared_down_proj.weight = param(hidden, shared, **kw)
            self.shared_expert_gate = nn.Module()
            self.shared_expert_gate.weight = param(1, hidden, **kw)
            if fused:
                from pagedserve.kernels import fused_ops

                self._silu_and_mul = fused_ops.silu_and_mul
            else:
                self._silu_and_mul = reference_ops.silu_and_mul

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = F.linear(x, self.gate.weight)  # [T, E]
        weights, ids = reference_moe.route(router_logits, self.top_k, self.renormalize)  # [T, K] each
        if self.round_weights:
            weights = weights.to(x.dtype)
        out = self._experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_gate_up_proj is not None:  # this rank's part of it: a sum over the ranks, as `out`
            shared = self._silu_and_mul(F.linear(x, self.shared_gate_up_proj.weight))
            shared = F.linear(shared, self.shared_down_proj.weight)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
        return self.parallel.all_reduce(out)


def moe_decoder_layer(
    layer: int,
    config: ModelConfig,
    backend: AttentionBackend,
    dtype: torch.dtype,
    device: torch.device,
    parallel: ParallelContext,
    fused: bool,
    round_weights: bool,
) -> LlamaDecoderLayer:
    """Decoder layer `layer` of a MoE model: a Llama decoder layer whose feed-forward block is a SparseMoE,
    or the dense one in `config.dense_layers` (Qwen-MoE's mlp_only_layers and decoder_sparse_step)."""
    if layer in config.dense_layers:
        return LlamaDecoderLayer(config, backend, dtype, device, parallel, fused)
    moe = SparseMoE(config, dtype, device, parallel, fused, round_weights)
    return LlamaDecoderLayer(config, backend, dtype, device, parallel, fused, mlp=moe)
