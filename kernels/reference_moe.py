"""The mixture-of-experts feed-forward in PyTorch: the reference of kernels/fused_moe.py and what the worker
runs on the CPU. The numerics are transformers' (MixtralExperts, Qwen3MoeExperts): each expert's SwiGLU in the
model dtype, its output scaled by the token's routing weight and rounded to the model dtype, and the experts'
outputs added in expert order.

It loops over the experts that some token chose, reading the routing on the host: fine on the CPU, but no
CUDA graph can hold it (worker/models/moe.py runs the Triton kernel on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    renormalize: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, top_k] float32, expert ids [T, top_k] int64
    """Softmax over the experts in float32, the top_k of them, renormalised to sum to 1 where the family
    does (Mixtral always, Qwen-MoE with `norm_topk_prob`)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: each expert's gate rows, then its up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, K]
    topk_ids: torch.Tensor,  # [T, K]
) -> torch.Tensor:  # [T, H]
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x[t]), each expert down(silu(gate(x)) * up(x))."""
    out = torch.zeros_like(x)
    num_experts = w13.shape[0]
    # [E, K, T]: which (slot, token) pairs chose each expert
    chosen = F.one_hot(topk_ids, num_classes=num_experts).permute(2, 1, 0)
    for expert in chosen.sum(dim=(1, 2)).nonzero().flatten().tolist():
        slot, token = torch.where(chosen[expert])
        gate, up = F.linear(x[token], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        y = y * topk_weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out
