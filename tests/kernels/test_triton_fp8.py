"""FP8 (e4m3) KV caches: the slot write's rounding against PyTorch's cast, and paged attention over an FP8
cache against the reference reading the same bytes (decode, split-KV, prefill, mixed; scales other than 1)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cache_ops, reference
from pagedserve.kernels.attention_config import AttentionConfig
from pagedserve.kernels.reference import FP8_DTYPE
from pagedserve.kernels.triton_attention import paged_attention
from tests.kernels.conftest import PagedBatch, gpu, make_paged_batch

SMALL_TILES = AttentionConfig(block_m=32, tile_n=16, num_warps=4, num_stages=2)
# What the reference computes from the same FP8 bytes differs from the kernel only in float rounding; the
# FP8 rounding itself is the same on both sides (the values stored are identical).
FP8_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


def _as_fp8(batch: PagedBatch, k_scale: float, v_scale: float) -> PagedBatch:
    """The batch with its pools stored in FP8 under the given scales (the pools keep their strides)."""
    fp8 = PagedBatch(**vars(batch))
    fp8.k_cache = reference.quantize(batch.k_cache, k_scale, FP8_DTYPE)
    fp8.v_cache = reference.quantize(batch.v_cache, v_scale, FP8_DTYPE)
    assert fp8.k_cache.stride() == batch.k_cache.stride()
    return fp8


def _check(batch: PagedBatch, k_scale: float, v_scale: float, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))  # poison: every element must be written
    paged_attention(
        **batch.attention_args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len, out=out,
        k_scale=k_scale, v_scale=v_scale, **kwargs,
    )  # fmt: skip
    up = torch.float64 if batch.query.device.type == "cpu" else torch.float32
    args = {**batch.attention_args(), "query": batch.query.to(up)}
    ref = reference.paged_attention(**args, k_scale=k_scale, v_scale=v_scale)
    assert torch.isfinite(out).all()
    starts = batch.query_start_loc.tolist()
    for b in range(len(starts) - 1):
        o, r = out[starts[b] : starts[b + 1]].double(), ref[starts[b] : starts[b + 1]].double()
        err = ((o - r).norm() / r.norm()).item()
        assert err < FP8_TOL[batch.query.dtype], f"sequence {b}: relative error {err:.2e}"
    return out


@pytest.mark.parametrize("dim", [32, 40])  # 40: rows padded to 64 in registers, masked
def test_write_kv_fp8_rounds_and_saturates_as_the_cast_does(device: torch.device, dim: int) -> None:
    # Values across e4m3's range at two scales: subnormals, ties, values that round up into the next power
    # of 2, values past 448 (saturated), tiny negatives (-0.0). Stored bytes must equal PyTorch's cast of
    # the clamped quotient, bit for bit; negative slots are skipped.
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, heads = 6, 16, 3
    for k_scale, v_scale, magnitude in [(0.37, 0.05, 3.0), (1.0, 1.0, 0.004), (2.0, 0.5, 300.0)]:
        qkv = torch.randn(40, 2 * heads + 1, dim, generator=gen) * magnitude
        special = torch.tensor([1.0625, 1.1875, 2**-10 * 3, 447.9, 464.0, 5000.0, -15.5, 127.3, -1e-6])
        qkv[0, 0, : len(special)] = qkv[1, heads + 1, : len(special)] = special * k_scale
        key, value = qkv[:, :heads].to(device), qkv[:, heads + 1 :].to(device)  # non-contiguous views
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:40].to(device)
        slots[5] = -1
        pool = lambda: torch.zeros(num_blocks, heads, block_size, dim, dtype=FP8_DTYPE, device=device)  # noqa: E731
        k_out, v_out, k_ref, v_ref = (reference.head_major(pool()) for _ in range(4))
        cache_ops.write_kv(key, value, k_out, v_out, slots, k_scale, v_scale)
        valid = slots >= 0
        reference.write_kv(key[valid], value[valid], k_ref, v_ref, slots[valid], k_scale, v_scale)
        for out, ref in ((k_out, k_ref), (v_out, v_ref)):
            assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
        # Saturation and -0.0 were exercised; no NaN came out.
        assert (k_ref.float().abs() == reference.FP8_MAX).any() and (
            v_ref.float().abs() == reference.FP8_MAX
        ).any()
        assert (k_ref.view(torch.uint8) == 0x80).any()
        assert not torch.isnan(k_ref.float()).any() and not torch.isnan(v_ref.float()).any()


@pytest.mark.parametrize("num_splits", [1, 3])
# Head size 128: FP8 tiles of 128 tokens; 64 with splits: the register prefetch.
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_decode_over_an_fp8_cache(device: torch.device, num_splits: int, head_dim: int) -> None:
    seq_lens = [1, 17, 64, 33, 150, 300]
    batch = make_paged_batch(
        seq_lens, [1] * len(seq_lens), 8, 2, head_dim, 16, device=device, seed=num_splits
    )
    fp8 = _as_fp8(batch, k_scale=0.02, v_scale=0.3)
    out = _check(fp8, 0.02, 0.3, num_splits=num_splits)
    # The scales are applied: the same bytes read with scale 1 give a different result.
    unscaled = paged_attention(
        **fp8.attention_args(), max_query_len=1, max_seq_len=fp8.max_seq_len, num_splits=num_splits
    )
    assert not torch.allclose(out, unscaled, atol=1e-3)
    # And FP8 approximates the full-precision cache (e4m3 keeps 3 mantissa bits: a few % per value).
    full = reference.paged_attention(**batch.attention_args())
    err = ((out - full).norm(dim=(1, 2)) / full.norm(dim=(1, 2))).max().item()
    assert err < 0.05, err


def test_decode_fp8_ignores_nan_bytes_outside_the_contexts(device: torch.device) -> None:
    # The decode path reads its first tile before it knows the length; FP8 NaN (0x7f) outside the contexts
    # must not reach the output.
    batch = _as_fp8(make_paged_batch([1, 40, 17], [1, 1, 1], 8, 2, 64, 16, device=device, seed=4), 0.05, 0.05)
    block_size = batch.k_cache.shape[1]
    inside = torch.zeros(batch.k_cache.shape[:2], dtype=torch.bool, device=device)
    for b, n in enumerate(batch.seq_lens.tolist()):
        pos = torch.arange(n, device=device)
        inside[batch.block_tables[b, pos // block_size].long(), pos % block_size] = True
    clean = _check(batch, 0.05, 0.05, num_splits=2)
    for cache in (batch.k_cache, batch.v_cache):
        cache.view(torch.uint8)[~inside] = 0x7F
    assert torch.isnan(batch.v_cache.float()).any()
    poisoned = paged_attention(
        **batch.attention_args(), max_query_len=1, max_seq_len=batch.max_seq_len, num_splits=2,
        k_scale=0.05, v_scale=0.05,
    )  # fmt: skip
    assert torch.equal(clean, poisoned)


@pytest.mark.parametrize(("num_decode_seqs", "head_dim"), [(0, 64), (2, 64), (2, 80)])
@pytest.mark.parametrize("config", [SMALL_TILES, None], ids=["small-tiles", "fp8-defaults"])
def test_prefill_and_mixed_over_an_fp8_cache(
    device: torch.device, num_decode_seqs: int, head_dim: int, config: AttentionConfig | None
) -> None:
    # None: the FP8 prefill tiles (prefill_config(64, fp8=True): 128 query rows x 64 tokens; at 80, those of
    # 128).
    seq_lens, q_lens = [40, 3, 37, 32, 70], [1, 1, 37, 5, 33]
    batch = make_paged_batch(seq_lens, q_lens, 8, 2, head_dim, 16, device=device, seed=7 + num_decode_seqs)
    _check(_as_fp8(batch, 0.1, 0.04), 0.1, 0.04, config=config, num_decode_seqs=num_decode_seqs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries_over_an_fp8_cache_multiply_in_fp16(
    device: torch.device, dtype: torch.dtype
) -> None:
    # With bf16 or fp16 queries the products run in fp16 (FP8_DOTS_IN_FP16): the query is converted once.
    seq_lens, q_lens = [1, 150, 40, 37], [1, 1, 3, 37]
    batch = make_paged_batch(seq_lens, q_lens, 8, 2, 64, 16, dtype, device, seed=12)
    fp8 = _as_fp8(batch, 0.03, 0.05)
    _check(fp8, 0.03, 0.05, num_splits=2, num_decode_seqs=2, config=SMALL_TILES)
    decodes = make_paged_batch(seq_lens, [1] * 4, 8, 2, 64, 16, dtype, device, seed=13)
    _check(_as_fp8(decodes, 0.03, 0.05), 0.03, 0.05)


@gpu
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_gpu_fp8_cache_full_shapes(head_dim: int) -> None:
    # bf16 queries over an FP8 cache: long decodes (the automatic split), then a prefill and a mixed batch.
    decode = make_paged_batch([8192 + 5, 1, 700, 2000], [1] * 4, 32, 8, head_dim, 16, torch.bfloat16, "cuda")
    _check(_as_fp8(decode, 0.03, 0.02), 0.03, 0.02)
    seq_lens, q_lens = [2048, 1500, 333] + [600] * 50, [2048, 1000, 333] + [1] * 50
    mixed = make_paged_batch(seq_lens, q_lens, 32, 8, head_dim, 16, torch.bfloat16, "cuda", seed=3)
    _check(_as_fp8(mixed, 0.03, 0.02), 0.03, 0.02)
    key = torch.randn(4096, 8, head_dim, device="cuda", dtype=torch.bfloat16) * 4
    k_out = torch.zeros(512, 16, 8, head_dim, dtype=FP8_DTYPE, device="cuda")
    k_ref, v_out, v_ref = k_out.clone(), k_out.clone(), k_out.clone()
    slots = torch.randperm(512 * 16, device="cuda")[:4096]
    cache_ops.write_kv(key, key, k_out, v_out, slots, 0.03, 0.02)
    reference.write_kv(key, key, k_ref, v_ref, slots, 0.03, 0.02)
    assert torch.equal(k_out.view(torch.uint8), k_ref.view(torch.uint8))
    assert torch.equal(v_out.view(torch.uint8), v_ref.view(torch.uint8))
