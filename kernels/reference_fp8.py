"""Per-token FP8 (e4m3) activation quantization in PyTorch: what the FP8 products
(worker/models/fp8_linear.py) run off CUDA, and the reference of the Triton kernels in kernels/fp8_quant.py,
which match it bit for bit.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.reference import FP8_DTYPE, FP8_MAX

MIN_SCALE = 1e-12  # an all-zero row keeps a finite scale (its values quantize to 0)
# A row's scale is its absolute maximum times float32(1 / 448), not divided by 448: PyTorch on CUDA divides by
# a Python scalar so (by its float32 reciprocal) and on the CPU it divides, so a division written here would
# give scales one unit in the last place apart on the two devices, and FP8 values apart with them.
INV_FP8_MAX = float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(FP8_MAX, dtype=torch.float32))


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] -> e4m3 [M, K], [M, 1]
    """Each row of `x` scaled by its own absolute maximum x float32(1 / 448) (at least MIN_SCALE), saturated
    and rounded to e4m3 (to nearest, ties to even): row i dequantizes as xq[i] * scale[i]."""
    scale = (x.abs().amax(dim=-1, keepdim=True).float() * INV_FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
