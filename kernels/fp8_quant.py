"""Per-token FP8 (e4m3) quantization of activations in one launch: each row of a [M, K] activation scaled by
its absolute maximum / 448 and rounded to e4m3, with its float32 scale, for the row-wise FP8 products of
worker/models/fp8_linear.py. PyTorch runs the same as seven kernels and a float32 copy of the activation.

The result is the reference's (kernels/reference_fp8.py) to the bit on every device: the scale is the absolute
maximum times float32(1 / 448) (PyTorch's own scalar division on CUDA), the scaled values are IEEE-rounded
divisions (`div_rn`; Triton's `/` is an approximate division on the GPU) and the e4m3 rounding
is done in integer operations (kernels/cache_ops.py `_round_to_e4m3`, which the interpreter also gets right).
Inputs are finite (a NaN or infinity in an activation gives another encoding of NaN than PyTorch's). No host
synchronisation: CUDA graphs capture it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.cache_ops import FP8_MAX, _round_to_e4m3
from pagedserve.kernels.reference import FP8_DTYPE
from pagedserve.kernels.reference_fp8 import INV_FP8_MAX as _INV_FP8_MAX
from pagedserve.kernels.reference_fp8 import MIN_SCALE as _MIN_SCALE

MIN_SCALE: tl.constexpr = tl.constexpr(_MIN_SCALE)
INV_FP8_MAX: tl.constexpr = tl.constexpr(_INV_FP8_MAX)
MAX_ONE_PASS = 8192  # rows up to this many elements are held in registers; longer ones are read twice


@triton.jit
def row_scale(absmax):
    """A row's float32 scale from its float32 absolute maximum (as kernels/reference_fp8.py computes it)."""
    return tl.maximum(absmax * INV_FP8_MAX, MIN_SCALE)


@triton.jit
def quantize_e4m3(x32, scale):
    """float32 values divided by their row's scale, saturated and rounded to e4m3 (still float32, exactly
    representable: the cast to FP8 on store is exact)."""
    return _round_to_e4m3(tl.clamp(tl.math.div_rn(x32, scale), -FP8_MAX, FP8_MAX))


@triton.jit
def _quantize_rows_kernel(
    out_ptr,  # [M, K] float8 e4m3
    scale_ptr,  # [M] float32
    x_ptr,  # [M, K] bf16, fp16 or float32
    K,
    stride_x,
    stride_o,
    BLOCK: tl.constexpr,  # a power of 2: the whole row (ONE_PASS) or the chunk each loop step takes
    ONE_PASS: tl.constexpr,  # K <= BLOCK: the row stays in registers between the maximum and the scaling
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_x
    out_row = out_ptr + row * stride_o
    offs = tl.arange(0, BLOCK)
    if ONE_PASS:
        ok = offs < K
        x = tl.load(x_row + offs, mask=ok, other=0.0).to(tl.float32)
        scale = row_scale(tl.max(tl.abs(x), 0))
        q = quantize_e4m3(x, scale)
        tl.store(out_row + offs, q.to(out_ptr.dtype.element_ty), mask=ok)
    else:
        absmax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, K, BLOCK):
            ok = start + offs < K
            x = tl.load(x_row + start + offs, mask=ok, other=0.0).to(tl.float32)
            absmax = tl.maximum(absmax, tl.abs(x))
        scale = row_scale(tl.max(absmax, 0))
        for start in range(0, K, BLOCK):
            ok = start + offs < K
            x = tl.load(x_row + start + offs, mask=ok, other=0.0).to(tl.float32)
            q = quantize_e4m3(x, scale)
            tl.store(out_row + start + offs, q.to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + row, scale)


def empty_per_token(num_rows: int, width: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Room for an activation quantized per token: e4m3 [num_rows, width], float32 scales [num_rows, 1]."""
    out = torch.empty(num_rows, width, dtype=FP8_DTYPE, device=device)
    return out, torch.empty(num_rows, 1, dtype=torch.float32, device=device)


def row_program(width: int, max_one_pass: int) -> dict[str, int | bool]:
    """The launch constants of a kernel with one program per row of `width` elements: the block it takes
    at a time, whether the row fits in one (else it is read twice: its maximum, then its values), warps."""
    block = min(triton.next_power_of_2(width), max_one_pass)
    return {"BLOCK": block, "ONE_PASS": width <= block, "num_warps": min(16, max(1, block // 512))}


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] -> e4m3 [M, K], [M, 1]
    """`reference_fp8.quantize_per_token` in one launch (one program per row); `x`'s rows may be strided."""
    assert x.dim() == 2 and x.stride(-1) == 1, (x.shape, x.stride())
    num_rows, k = x.shape
    out, scale = empty_per_token(num_rows, k, x.device)
    if num_rows:
        _quantize_rows_kernel[(num_rows,)](
            out, scale, x, k, x.stride(0), out.stride(0), **row_program(k, MAX_ONE_PASS)
        )  # fmt: skip
    return out, scale
