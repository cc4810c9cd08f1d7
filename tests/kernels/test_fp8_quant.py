"""Per-token e4m3 quantization (kernels/fp8_quant.py) against its PyTorch reference, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import fp8_quant, fused_ops, reference_fp8
from tests.kernels.conftest import gpu


def _assert_same(x: torch.Tensor) -> None:
    q, scale = fp8_quant.quantize_per_token(x)
    want_q, want_scale = reference_fp8.quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert q.shape == x.shape and scale.shape == (x.shape[0], 1)
    assert torch.equal(scale, want_scale), (scale - want_scale).abs().max()
    same = q.view(torch.uint8) == want_q.view(torch.uint8)
    assert same.all(), f"{int((~same).sum())} of {same.numel()} bytes differ, first at {(~same).nonzero()[0]}"


def _rows(m: int, k: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Rows of very different magnitudes (1e-30 to 1e30), so values fall on the e4m3 subnormals, on ties
    and at the saturation edge."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-30, 30, m)[:, None].clamp(max=1e30)
    return x.to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("m", "k"), [(1, 16), (7, 80), (5, 1000), (3, 4096)])
def test_quantize_per_token_matches_the_reference(
    device: torch.device, dtype: torch.dtype, m: int, k: int
) -> None:
    x = _rows(m, k, dtype, device, seed=m * k)
    if dtype == torch.float16:  # its range: 6e4
        x = x.float().clamp(-6e4, 6e4).to(dtype)
    _assert_same(x)


@pytest.mark.parametrize("k", [9000, 14336, 28672])  # past MAX_ONE_PASS: two passes over the row, a tail
def test_long_rows_are_read_twice_with_the_same_result(device: torch.device, k: int) -> None:
    _assert_same(_rows(3, k, torch.bfloat16, device, seed=k))


@pytest.mark.parametrize("max_one_pass", [16, 64])
def test_the_two_pass_loop_equals_the_one_pass_kernel(
    device: torch.device, max_one_pass: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    x = _rows(6, 200, torch.bfloat16, device, seed=3)
    one_pass = fp8_quant.quantize_per_token(x)
    monkeypatch.setattr(fp8_quant, "MAX_ONE_PASS", max_one_pass)
    looped = fp8_quant.quantize_per_token(x)
    assert torch.equal(one_pass[0].view(torch.uint8), looped[0].view(torch.uint8))
    assert torch.equal(one_pass[1], looped[1])
    _assert_same(x)


def test_zero_rows_huge_values_and_exact_ties(device: torch.device) -> None:
    x = torch.zeros(6, 48)
    x[1] = 3.0e38  # near bf16's maximum: the scale is huge, every value 448
    x[1, ::2] = -3.3e38
    x[2, 0] = 448.0  # scale 1: the values below are e4m3 ties and subnormals as they stand
    x[2, 1:9] = torch.tensor([17.0, 19.0, 2.0**-9 * 1.5, 2.0**-9 * 2.5, 2.0**-10, -(2.0**-10), 0.3, -0.0])
    x[3, 5] = 1e-38  # one tiny value, the rest zero: the scale's lower bound
    x[4] = torch.linspace(-1, 1, 48)
    x[5, :3] = torch.tensor([1e30, -1e-30, 7.0])
    _assert_same(x.to(torch.bfloat16).to(device))
    _assert_same(x.to(device))


def test_strided_rows_and_no_rows(device: torch.device) -> None:
    x = _rows(5, 96, torch.bfloat16, device, seed=9)
    _assert_same(x[:, 16:80])  # rows 96 elements apart
    q, scale = fp8_quant.quantize_per_token(x[:0])
    assert q.shape == (0, 96) and scale.shape == (0, 1)


@gpu
@pytest.mark.parametrize(("m", "k"), [(1, 4096), (256, 4096), (4096, 14336), (8, 28672)])
def test_quantize_per_token_matches_the_reference_at_model_shapes(m: int, k: int) -> None:
    """The 8B shape's activations on the GPU (the division and the rounding as compiled there)."""
    gen = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(m, k, generator=gen, device="cuda") * torch.logspace(-3, 3, m, device="cuda")[:, None]
    _assert_same(x.to(torch.bfloat16))


@gpu
def test_quantize_per_token_captures_in_a_cuda_graph() -> None:
    x = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    fp8_quant.quantize_per_token(x)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, scale = fp8_quant.quantize_per_token(x)
    x.copy_(torch.randn_like(x) * 5)
    graph.replay()
    want_q, want_scale = reference_fp8.quantize_per_token(x)
    assert torch.equal(scale, want_scale) and torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))


# ---------------------------------------------------------------------------------------------------------
# The FP8 forms of the fused RMSNorm and SiLU-and-mul (kernels/fused_ops.py): their bf16 kernels' result,
# quantized by the kernel above, to the bit.


def _assert_bits(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))


def _assert_bits_but_rare_steps(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    """The scales to the bit; the values to the bit but at most one in a million, each one e4m3 step away (an
    eighth of its magnitude, or the subnormal step 2^-9). For a normed row: two compilations of one Triton
    kernel may sum a row's squares in another order, so a row's 1/rms can be a float32 unit apart, and an
    element whose bf16 value then rounds the other way can cross an e4m3 tie (on an H200: 4 of 16.8M)."""
    assert torch.equal(got[1], want[1])
    g, w = got[0].float(), want[0].float()
    differ = g != w
    assert differ.sum().item() <= g.numel() // 1_000_000, differ.sum().item()
    step = torch.maximum(g.abs(), w.abs()) / 8 + 2.0**-9
    assert bool(((g - w).abs() <= step)[differ].all())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 64), (7, 80), (3, 1000)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_fp8_is_the_quantized_rms_norm(
    device: torch.device, dtype: torch.dtype, num_tokens: int, hidden: int, with_residual: bool
) -> None:
    gen = torch.Generator().manual_seed(hidden)
    x = (torch.randn(num_tokens, hidden, generator=gen) * 4).to(dtype).to(device)
    x[0, : hidden // 2] = 0  # a row whose half is zero; the norm of a zero row is zero
    if num_tokens > 2:
        x[2] = 0
    weight = torch.randn(hidden, generator=gen).to(dtype).to(device)
    residual = (
        (torch.randn(num_tokens, hidden, generator=gen)).to(dtype).to(device) if with_residual else None
    )
    want_res = residual.clone() if residual is not None else None
    want_out, want_res = fused_ops.rms_norm(x, weight, 1e-6, want_res)
    q, scale, res = fused_ops.rms_norm_fp8(x, weight, 1e-6, residual)
    _assert_bits((q, scale), fp8_quant.quantize_per_token(want_out))
    if with_residual:
        assert res is residual and torch.equal(res, want_res)
    else:
        assert res is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("num_tokens", "inter"), [(1, 16), (5, 344), (2, 3000)])
def test_silu_and_mul_fp8_is_the_quantized_silu_and_mul(
    device: torch.device, dtype: torch.dtype, num_tokens: int, inter: int
) -> None:
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(num_tokens, 2 * inter, generator=gen) * 3).to(dtype).to(device)
    gate_up[0, inter:] = 0  # up all zero: a zero row
    want = fp8_quant.quantize_per_token(fused_ops.silu_and_mul(gate_up))
    _assert_bits(fused_ops.silu_and_mul_fp8(gate_up), want)


@pytest.mark.parametrize("max_one_pass", [64, 256])
def test_silu_and_mul_fp8_computes_long_rows_twice_with_the_same_result(
    device: torch.device, max_one_pass: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    gen = torch.Generator().manual_seed(max_one_pass)
    gate_up = (torch.randn(4, 2 * 600, generator=gen) * 3).to(torch.bfloat16).to(device)
    want = fp8_quant.quantize_per_token(fused_ops.silu_and_mul(gate_up))
    monkeypatch.setattr(fused_ops, "MAX_ONE_PASS_SILU", max_one_pass)
    _assert_bits(fused_ops.silu_and_mul_fp8(gate_up), want)


def test_fp8_forms_take_no_tokens(device: torch.device) -> None:
    q, scale = fused_ops.silu_and_mul_fp8(torch.zeros(0, 64, dtype=torch.bfloat16, device=device))
    assert q.shape == (0, 32) and scale.shape == (0, 1)
    x = torch.zeros(0, 64, dtype=torch.bfloat16, device=device)
    q, scale, _ = fused_ops.rms_norm_fp8(x, torch.ones(64, dtype=torch.bfloat16, device=device), 1e-6)
    assert q.shape == (0, 64) and scale.shape == (0, 1)


@gpu
@pytest.mark.parametrize("num_tokens", [1, 256, 4096])
def test_fp8_forms_at_the_8b_shape(num_tokens: int) -> None:
    """Hidden 4096, intermediate 14336 on the GPU: the fused forms' bits are the two-kernel chains' (the
    normed rows' but for rare one-step ties, `_assert_bits_but_rare_steps`)."""
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = torch.randn(num_tokens, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    weight = torch.randn(4096, generator=gen, device="cuda").to(torch.bfloat16)
    residual = torch.randn(num_tokens, 4096, generator=gen, device="cuda").to(torch.bfloat16)
    want_out, want_res = fused_ops.rms_norm(x, weight, 1e-5, residual.clone())
    q, scale, res = fused_ops.rms_norm_fp8(x, weight, 1e-5, residual)
    _assert_bits_but_rare_steps((q, scale), fp8_quant.quantize_per_token(want_out))
    assert torch.equal(res, want_res)
    gate_up = (torch.randn(num_tokens, 2 * 14336, generator=gen, device="cuda") * 3).to(torch.bfloat16)
    want = fp8_quant.quantize_per_token(fused_ops.silu_and_mul(gate_up))
    _assert_bits(fused_ops.silu_and_mul_fp8(gate_up), want)
