"""Triton kernels for the model's elementwise chains: RMSNorm (with the residual add before it), RoPE and
SiLU-and-mul, each one launch where PyTorch runs 2-9 kernels. RMSNorm and SiLU-and-mul also come in an FP8
form for a projection with FP8 products (worker/models/fp8_linear.py): their result quantized per token to
e4m3 with its scale in the same launch, the bits of kernels/fp8_quant.py on their bf16 result.

Each rounds where the PyTorch ops in worker/models/layers.py round (every op's result goes back to the
model dtype, RMSNorm's statistics stay in float32), so the results match them to the last bit but for
float32 reductions in another order and the exponential. Their references are those PyTorch ops, in
kernels/reference_ops.py (what the model runs when the kernels are off).

The intermediate roundings are integer operations (`_round`): written as a float round trip,
`x.to(tl.bfloat16).to(tl.float32)`, the compiler dropped some of them on the H100 and fused the products
into FMAs (a quarter of RoPE's bf16 outputs came out one unit off PyTorch's).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.fp8_quant import empty_per_token, quantize_e4m3, row_program, row_scale

# ---------------------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Float32 `x` rounded to `dtype`'s precision (to nearest, ties to even), still float32: exactly the
    value `x.to(dtype)` holds within dtype's normal range, which the store's conversion then keeps."""
    if dtype == tl.float32:
        return x
    elif dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)  # drop 16 of float32's 23 mantissa bits
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    else:
        tl.static_assert(dtype == tl.float16)
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0xFFF + ((bits >> 13) & 1)  # drop 13 of them
        return ((bits >> 13) << 13).to(tl.float32, bitcast=True)


@triton.jit
def _rms_norm_kernel(
    out_ptr,  # [R, N]
    x_ptr,  # [R, N]
    residual_ptr,  # [R, N], read and overwritten with x + residual (HAS_RESIDUAL)
    weight_ptr,  # [N]
    scale_ptr,  # [R] float32, each row's e4m3 scale (FP8_OUT)
    eps,
    N,
    stride_o,
    stride_x,
    stride_r,
    BLOCK: tl.constexpr,  # next power of 2 of N
    HAS_RESIDUAL: tl.constexpr,
    FP8_OUT: tl.constexpr,  # out is e4m3: the row (in x's dtype) quantized per token
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=ok, other=0.0)
        x = _round(x.to(tl.float32) + r.to(tl.float32), r.dtype)  # rounded as the model dtype's add rounds
        tl.store(residual_ptr + row * stride_r + offs, x.to(r.dtype), mask=ok)
    x32 = x.to(tl.float32)
    normed = x32 * (1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / N + eps))
    w = tl.load(weight_ptr + offs, mask=ok, other=0.0)
    y = _round(w.to(tl.float32) * _round(normed, x_ptr.dtype.element_ty), x_ptr.dtype.element_ty)
    if FP8_OUT:
        scale = row_scale(tl.max(tl.abs(y), 0))
        y = quantize_e4m3(y, scale)
        tl.store(scale_ptr + row, scale)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(
    x_ptr,  # [T, H, D], rotated in place
    positions_ptr,  # [T]
    cos_ptr,  # [max_len, D]
    sin_ptr,  # [max_len, D]
    num_heads,
    stride_t,
    stride_h,
    stride_cos,
    HEAD_DIM: tl.constexpr,  # the rotated dimensions of a head (all of them, or a partial rotary's)
    HEADS: tl.constexpr,  # heads per program, a power of 2
    HALF_PAD: tl.constexpr,  # HEAD_DIM // 2 rounded up to a power of 2 (Phi-3's 96 dimensions: 64)
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)
    half = tl.arange(0, HALF_PAD)
    ok = (h < num_heads)[:, None] & (half < HEAD_DIM // 2)[None, :]
    pos = tl.load(positions_ptr + t).to(tl.int64)
    in_half = half < HEAD_DIM // 2
    c = tl.load(cos_ptr + pos * stride_cos + half, mask=in_half).to(tl.float32)[None, :]  # halves equal
    s1 = tl.load(sin_ptr + pos * stride_cos + half, mask=in_half).to(tl.float32)[None, :]
    s2 = tl.load(sin_ptr + pos * stride_cos + HEAD_DIM // 2 + half, mask=in_half).to(tl.float32)[None, :]
    ptr1 = x_ptr + t * stride_t + h[:, None] * stride_h + half[None, :]
    ptr2 = ptr1 + HEAD_DIM // 2
    x1 = tl.load(ptr1, mask=ok, other=0.0)
    x2 = tl.load(ptr2, mask=ok, other=0.0)
    dt = x1.dtype
    # x * cos + rotate_half(x) * sin, each product and the sum rounded to the model dtype as PyTorch does.
    a1 = _round(x1.to(tl.float32) * c, dt)
    b1 = _round(-x2.to(tl.float32) * s1, dt)
    a2 = _round(x2.to(tl.float32) * c, dt)
    b2 = _round(x1.to(tl.float32) * s2, dt)
    tl.store(ptr1, _round(a1 + b1, dt).to(dt), mask=ok)
    tl.store(ptr2, _round(a2 + b2, dt).to(dt), mask=ok)


@triton.jit
def _silu_and_mul_chunk(gate_up_row, offs, ok, inter, OUT_DTYPE: tl.constexpr):
    """SiLU(gate) * up at `offs` of one token's [2I] row, rounded as the PyTorch ops round, in float32."""
    g = tl.load(gate_up_row + offs, mask=ok, other=0.0)
    u = tl.load(gate_up_row + inter + offs, mask=ok, other=0.0)
    g32 = g.to(tl.float32)
    act = _round(g32 / (1.0 + tl.exp(-g32)), g.dtype)  # silu, rounded as F.silu's result is
    return _round(act * u.to(tl.float32), OUT_DTYPE)


@triton.jit
def _silu_and_mul_kernel(
    out_ptr,  # [T, I]
    gate_up_ptr,  # [T, 2I]: gate, then up
    inter,
    stride_o,
    stride_g,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    out = _silu_and_mul_chunk(gate_up_ptr + t * stride_g, offs, ok, inter, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _silu_and_mul_fp8_kernel(
    out_ptr,  # [T, I] float8 e4m3
    scale_ptr,  # [T] float32
    gate_up_ptr,  # [T, 2I]: gate, then up
    inter,
    stride_o,
    stride_g,
    BLOCK: tl.constexpr,  # a power of 2: the whole row (ONE_PASS) or the chunk each loop step takes
    ONE_PASS: tl.constexpr,  # inter <= BLOCK: the row stays in registers; else it is computed twice
):
    t = tl.program_id(0).to(tl.int64)
    row = gate_up_ptr + t * stride_g
    out_row = out_ptr + t * stride_o
    offs = tl.arange(0, BLOCK)
    dt = gate_up_ptr.dtype.element_ty
    if ONE_PASS:
        ok = offs < inter
        y = _silu_and_mul_chunk(row, offs, ok, inter, dt)
        scale = row_scale(tl.max(tl.abs(y), 0))
        tl.store(out_row + offs, quantize_e4m3(y, scale).to(out_ptr.dtype.element_ty), mask=ok)
    else:
        absmax = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, inter, BLOCK):
            y = _silu_and_mul_chunk(row, start + offs, start + offs < inter, inter, dt)
            absmax = tl.maximum(absmax, tl.abs(y))
        scale = row_scale(tl.max(absmax, 0))
        for start in range(0, inter, BLOCK):
            ok = start + offs < inter
            y = _silu_and_mul_chunk(row, start + offs, ok, inter, dt)
            tl.store(out_row + start + offs, quantize_e4m3(y, scale).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(scale_ptr + t, scale)


# ---------------------------------------------------------------------------------------------------------
# Entry points


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`reference_ops.rms_norm` in one launch, over the last dimension of `x` (any leading shape whose rows
    are evenly strided). With `residual`, it is overwritten in place with x + residual and returned."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    assert rows.stride(-1) == 1 and weight.shape == (n,)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    res = rows
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous()
        res = residual.view(-1, n)
    _launch_rms_norm(out, None, rows, res, weight, eps, residual is not None)
    return out.view(x.shape), residual


def rms_norm_fp8(
    x: torch.Tensor,  # [T, N]
    weight: torch.Tensor,  # [N]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, N]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # e4m3 [T, N], scale [T, 1], residual
    """`rms_norm`'s result quantized per token (`fp8_quant.quantize_per_token` of it, to the bit) in the
    same launch: what an FP8 projection takes. The residual is updated as `rms_norm` updates it."""
    assert x.dim() == 2 and x.stride(-1) == 1 and weight.shape == (x.shape[1],)
    out, scale = empty_per_token(x.shape[0], x.shape[1], x.device)
    res = x
    if residual is not None:
        assert residual.shape == x.shape and residual.is_contiguous()
        res = residual
    _launch_rms_norm(out, scale, x, res, weight, eps, residual is not None)
    return out, scale, residual


def _launch_rms_norm(
    out: torch.Tensor,
    scale: torch.Tensor | None,
    rows: torch.Tensor,
    res: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    has_residual: bool,
) -> None:
    n = rows.shape[1]
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            out, rows, res, weight, out if scale is None else scale, eps, n, out.stride(0), rows.stride(0),
            res.stride(0), BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=has_residual,
            FP8_OUT=scale is not None, num_warps=min(8, max(1, triton.next_power_of_2(n) // 256)),
        )  # fmt: skip


def _rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    num_tokens, num_heads, head_dim = x.shape
    assert x.stride(-1) == 1 and cos.stride() == sin.stride() and cos.stride(-1) == 1
    # a power of 2 of heads per program, at most 2048 elements (2048 // 96 is 21: Phi-3-mini's 32 heads of 96)
    heads = min(triton.next_power_of_2(num_heads), 1 << (max(1, 2048 // head_dim).bit_length() - 1))
    _rope_kernel[(num_tokens, triton.cdiv(num_heads, heads))](
        x, positions, cos, sin, num_heads, x.stride(0), x.stride(1), cos.stride(0),
        HEAD_DIM=head_dim, HEADS=heads, HALF_PAD=triton.next_power_of_2(head_dim // 2), num_warps=4,
    )  # fmt: skip


def rope_(
    positions: torch.Tensor,  # [T]
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos: torch.Tensor,  # [max_len, D]
    sin: torch.Tensor,  # [max_len, D]
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference_ops.rope`, rotating `query` and `key` in place (views of the fused QKV output are fine)."""
    if query.shape[0]:
        _rope_(query, positions, cos, sin)
        _rope_(key, positions, cos, sin)
    return query, key


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """`reference_ops.silu_and_mul` in one launch."""
    num_tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    assert gate_up.stride(-1) == 1
    out = torch.empty(num_tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(inter))
    if num_tokens:
        _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            out, gate_up, inter, out.stride(0), gate_up.stride(0), BLOCK=block, num_warps=4
        )
    return out


MAX_ONE_PASS_SILU = 16384  # longer rows (per rank) are computed twice: once for the maximum, once to store


def silu_and_mul_fp8(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, 2I] -> [T, I], [T, 1]
    """`silu_and_mul`'s result quantized per token (`fp8_quant.quantize_per_token` of it, to the bit) in the
    same launch, one program per token: what an FP8 down projection takes."""
    num_tokens, two_inter = gate_up.shape
    inter = two_inter // 2
    assert gate_up.stride(-1) == 1
    out, scale = empty_per_token(num_tokens, inter, gate_up.device)
    if num_tokens:
        _silu_and_mul_fp8_kernel[(num_tokens,)](
            out, scale, gate_up, inter, out.stride(0), gate_up.stride(0),
            **row_program(inter, MAX_ONE_PASS_SILU),
        )  # fmt: skip
    return out, scale
