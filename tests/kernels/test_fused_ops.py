"""The fused elementwise kernels (kernels/fused_ops.py) against the PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import fused_ops, reference_ops
from tests.kernels.conftest import gpu

# Float32 differs from the PyTorch ops only in the order of RMSNorm's sum; half precision in a rounding now
# and then (the kernel's exp and reciprocal square root are not PyTorch's to the last bit).
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-6),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
    torch.bfloat16: dict(rtol=1.6e-2, atol=1e-2),
}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(*shape: int, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 80])  # 80: not a power of 2, the tail is masked
@pytest.mark.parametrize("num_tokens", [1, 7])
def test_rms_norm_with_and_without_the_residual_add(
    device: torch.device, dtype: torch.dtype, hidden: int, num_tokens: int
) -> None:
    x = _rand(num_tokens, hidden, dtype=dtype, device=device, seed=hidden) * 3
    weight = _rand(hidden, dtype=dtype, device=device, seed=1)
    residual = _rand(num_tokens, hidden, dtype=dtype, device=device, seed=2)

    out, none = fused_ops.rms_norm(x, weight, 1e-5)
    want, _ = reference_ops.rms_norm(x, weight, 1e-5)
    assert none is None
    torch.testing.assert_close(out, want, **TOL[dtype])

    before = residual.clone()
    out, new_residual = fused_ops.rms_norm(x, weight, 1e-5, residual)
    want, want_residual = reference_ops.rms_norm(x, weight, 1e-5, before)
    assert new_residual is residual  # written in place
    torch.testing.assert_close(residual, want_residual, rtol=0, atol=0)  # one rounded add: exact
    torch.testing.assert_close(out, want, **TOL[dtype])


def test_rms_norm_over_head_dim_of_a_strided_view(device: torch.device) -> None:
    # Qwen3's q/k norms: the heads of q, a view into the fused QKV output, normed over head_dim.
    qkv = _rand(5, 3 * 4 * 16, dtype=torch.float32, device=device, seed=3)
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    weight = _rand(16, dtype=torch.float32, device=device, seed=4)
    out, _ = fused_ops.rms_norm(q, weight, 1e-6)
    assert out.shape == q.shape
    torch.testing.assert_close(out, reference_ops.rms_norm(q, weight, 1e-6)[0], **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [
        (4, 2, 32, 32), (6, 3, 64, 64), (2, 1, 16, 16), (2, 1, 24, 24),
        (4, 2, 96, 96), (2, 1, 80, 80),  # heads of 96 (Phi-3); 80: halves of 40, padded to 64
        (32, 32, 96, 96),  # Phi-3-mini: 2048 // 96 = 21 heads would fit a program, 16 (a power of 2) do
        (4, 2, 128, 96), (2, 1, 96, 40),  # partial rotary (Phi-4-mini: 0.75 of 128): the rest untouched
    ],
)  # fmt: skip
def test_rope_rotates_query_and_key_views_in_place(
    device: torch.device,
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
) -> None:
    num_tokens, max_len = 9, 50
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(device, dtype), emb.sin().to(device, dtype)
    positions = torch.tensor([0, 1, 49, 3, 17, 17, 2, 30, 8], device=device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = _rand(num_tokens, q_size + 2 * kv_size, dtype=dtype, device=device, seed=head_dim) * 2
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    # The rotated part of each head as worker/models/rotary.py hands it over: a view, rows head_dim apart.
    q_rot, k_rot = q[..., :rotary_dim], k[..., :rotary_dim]
    want_q, want_k = reference_ops.rope(positions, q_rot.clone(), k_rot.clone(), cos, sin)
    before = qkv.clone()

    out_q, out_k = fused_ops.rope_(positions, q_rot, k_rot, cos, sin)

    assert out_q is q_rot and out_k is k_rot
    # In half precision every product and sum is rounded as PyTorch rounds it: the same bits. In float32 the
    # GPU's compiler fuses a product and the sum into one FMA, rounded once.
    exact = dict(rtol=0, atol=0) if dtype != torch.float32 else TOL[dtype]
    torch.testing.assert_close(q_rot, want_q, **exact)
    torch.testing.assert_close(k_rot, want_k, **exact)
    # The rest of the QKV buffer (v, the heads' dimensions past the rotary ones) is untouched.
    untouched = torch.ones_like(qkv, dtype=torch.bool)
    untouched[:, :q_size].view(num_tokens, num_heads, head_dim)[..., :rotary_dim] = False
    untouched[:, q_size : q_size + kv_size].view(num_tokens, num_kv_heads, head_dim)[..., :rotary_dim] = False
    assert torch.equal(qkv[untouched], before[untouched])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "inter"), [(1, 48), (6, 200), (3, 1500)])  # 1500: two programs a row
def test_silu_and_mul(device: torch.device, dtype: torch.dtype, num_tokens: int, inter: int) -> None:
    gate_up = _rand(num_tokens, 2 * inter, dtype=dtype, device=device, seed=inter) * 4
    out = fused_ops.silu_and_mul(gate_up)
    torch.testing.assert_close(out, reference_ops.silu_and_mul(gate_up), **TOL[dtype])


@gpu
def test_gpu_fused_ops_bf16_at_model_shapes() -> None:
    device = torch.device("cuda")
    bf16 = dict(rtol=1.6e-2, atol=1e-2)
    x = _rand(300, 2048, dtype=torch.bfloat16, device=device, seed=0) * 3
    residual = _rand(300, 2048, dtype=torch.bfloat16, device=device, seed=1)
    weight = _rand(2048, dtype=torch.bfloat16, device=device, seed=2)
    want, want_residual = reference_ops.rms_norm(x, weight, 1e-5, residual.clone())
    out, residual = fused_ops.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(residual, want_residual)
    torch.testing.assert_close(out, want, **bf16)
    assert (out != want).float().mean() < 0.01  # a rounding now and then, not a different formula

    gate_up = _rand(300, 2 * 8192, dtype=torch.bfloat16, device=device, seed=3) * 4
    out = fused_ops.silu_and_mul(gate_up)
    want = reference_ops.silu_and_mul(gate_up)
    torch.testing.assert_close(out, want, **bf16)
    assert (out != want).float().mean() < 0.01

    emb = torch.outer(torch.arange(4096, dtype=torch.float32), torch.rand(64))
    cos, sin = (torch.cat((f, f), -1).to(device, torch.bfloat16) for f in (emb.cos(), emb.sin()))
    positions = torch.randint(0, 4096, (300,), device=device)
    qkv = _rand(300, (32 + 16) * 128, dtype=torch.bfloat16, device=device, seed=4)
    q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
    q, k = q.view(300, 32, 128), k.view(300, 8, 128)
    want_q, want_k = reference_ops.rope(positions, q.clone(), k.clone(), cos, sin)
    fused_ops.rope_(positions, q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)  # products and sum rounded as PyTorch rounds
