"""The model's elementwise chains in PyTorch: what the worker runs on the CPU (and on CUDA unless
`--fused-ops`), and the references of the Triton kernels in kernels/fused_ops.py. The numerics are
transformers' Llama's: RMSNorm's statistics in float32, every other op's result in the model dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of `x` (of `x + residual` when given, which is also returned as the new residual), in float32,
    scaled by `weight` in the model dtype."""
    if residual is not None:
        x = residual = x + residual
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), residual


def rope(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [max_len, D], halves equal
    sin: torch.Tensor,  # [max_len, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox-style rotate-half RoPE, as transformers' Llama applies it."""
    c = cos[positions][:, None, :]
    s = sin[positions][:, None, :]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    return query * c + rotate_half(query) * s, key * c + rotate_half(key) * s


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_and_mul(gate_up: torch.Tensor, approximate: str) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate=approximate) * up
