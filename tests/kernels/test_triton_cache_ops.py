"""KV cache ops: the Triton slot write against the reference, and block copies across all layers."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.cache_ops import copy_blocks, write_kv
from pagedserve.kernels.reference import kv_pool
from tests.kernels.conftest import gpu


def _caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype, device, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [
        tuple(torch.randn(shape, generator=gen).to(dtype=dtype, device=device) for _ in range(2))
        for _ in range(num_layers)
    ]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize(
    ("num_kv_heads", "dtype"), [(2, torch.float32), (3, torch.float16), (8, torch.float32)]
)
@pytest.mark.parametrize("layout", ["head", "token"])
@pytest.mark.parametrize("head_dim", [64, 96])  # 96: rows padded to 128 in registers, never in the cache
def test_write_kv_matches_reference(
    device: torch.device, block_size: int, num_kv_heads: int, dtype: torch.dtype, layout: str, head_dim: int
) -> None:
    gen = torch.Generator().manual_seed(block_size + num_kv_heads)
    num_blocks, num_tokens = 9, 2 * block_size + 5
    pool_gen = torch.Generator().manual_seed(1)

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=pool_gen).to(dtype=dtype, device=device)

    k_cache, v_cache = (kv_pool(make, num_blocks, block_size, num_kv_heads, head_dim, layout) for _ in "kv")
    # Keys and values as the model hands them over: views into one fused projection, not contiguous.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype=dtype, device=device)
    key, value = qkv[:, num_kv_heads : 2 * num_kv_heads], qkv[:, 2 * num_kv_heads :]
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens].to(device)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, k_ref, v_ref, slots)

    write_kv(key, value, k_cache, v_cache, slots)

    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_write_kv_skips_negative_slots(device: torch.device) -> None:
    [(k_cache, v_cache)] = _caches(1, (4, 16, 2, 64), torch.float32, device, 2)
    before = k_cache.clone(), v_cache.clone()
    key = torch.randn(3, 2, 64, device=device)
    slots = torch.tensor([-1, 5, -1], device=device)

    write_kv(key, key + 1, k_cache, v_cache, slots)

    assert torch.equal(k_cache.view(-1, 2, 64)[5], key[1])
    assert torch.equal(v_cache.view(-1, 2, 64)[5], key[1] + 1)
    k_cache.view(-1, 2, 64)[5] = before[0].view(-1, 2, 64)[5]
    v_cache.view(-1, 2, 64)[5] = before[1].view(-1, 2, 64)[5]
    assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1])


def _pool_copy_reference(pool: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """What copy_blocks must do, as worker/kv_cache.py does it in PyTorch: gather, then scatter."""
    expected = pool.clone()
    expected.index_copy_(2, dst, expected.index_select(2, src))
    return expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_copy_blocks_copies_every_layer_and_nothing_else(
    device: torch.device, dtype: torch.dtype, head_dim: int
) -> None:
    gen = torch.Generator(device=device).manual_seed(3)
    pool = torch.randn(3, 2, 10, 16, 2, head_dim, generator=gen, device=device).to(
        dtype
    )  # [L, 2, blocks, ...]
    src = torch.tensor([1, 4, 1], device=device)  # a block copied twice, as after two forks
    dst = torch.tensor([7, 2, 9], device=device)
    expected = _pool_copy_reference(pool, src, dst)

    copy_blocks(pool, src, dst)

    assert torch.equal(pool, expected)


@gpu
@pytest.mark.parametrize("head_dim", [128, 96])
def test_gpu_write_kv_and_copy_blocks_full_shapes(head_dim: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(6)
    pool = torch.randn(4, 2, 2000, 16, 8, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    k_cache, v_cache = pool[1, 0], pool[1, 1]
    key = torch.randn(3000, 8, head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    slots = torch.randperm(2000 * 16, device="cuda")[:3000]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, -key, k_ref, v_ref, slots)
    write_kv(key, -key, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)

    perm = torch.randperm(2000, device="cuda")
    src, dst = perm[:700], perm[700:1400]
    expected = _pool_copy_reference(pool, src, dst)
    copy_blocks(pool, src, dst)
    assert torch.equal(pool, expected)
