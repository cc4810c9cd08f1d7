"""KV cache maintenance: writing new keys/values into their slots, copy-on-write block copies, swaps.

Layout per layer as in `kernels.reference`: K and V pools indexed `[num_blocks, block_size, Hkv, D]`, read and
written through their strides (the worker's blocks are head-major in memory).

- `write_kv`: one Triton launch stores K and V of every token through the slot mapping (the reference
  needs two index_put launches), at any head size (rows padded to a power of 2 in registers, masked, never
  in the cache); into an FP8 cache it stores each value times the reciprocal of the pool's
  per-tensor scale, saturated, rounded to nearest (`kernels.reference.quantize`).
- `copy_blocks`: one Triton launch copies src -> dst block pairs in every layer's K and V, over the worker's
  all-layer pool `[L, 2, num_blocks, Hkv, block_size, D]` (worker/kv_cache.py; any layout within a block),
  each byte read and written once.
- Swaps between the GPU pool and the pinned, block-major CPU pool stay PyTorch ops (`worker.kv_cache`:
  a gather or scatter on the GPU and one asynchronous transfer per run of consecutive CPU blocks): the host
  link is the bottleneck, not the gather.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.reference import FP8_MAX as _FP8_MAX
from pagedserve.kernels.reference import byte_view, is_fp8

FP8_MAX: tl.constexpr = tl.constexpr(_FP8_MAX)
FP8_MIN_NORMAL: tl.constexpr = tl.constexpr(2.0**-6)
# Adding and subtracting 1.5 * 2^14 rounds a float32 of magnitude below 2^13 to a multiple of 2^-9 (the
# float32 spacing there), to nearest even: the e4m3 subnormals' grid.
SUBNORMAL_MAGIC: tl.constexpr = tl.constexpr(1.5 * 2.0**14)


@triton.jit
def _round_to_e4m3(x):
    """float32 `x` (within +-FP8_MAX) rounded to the nearest float8 e4m3 value, ties to even, still as
    float32: its cast to FP8 is then exact. The rounding is done here, not by the cast, because Triton's
    interpreter (what CI runs) rounds wrongly when the carry moves a value into the next power of 2
    (127.3 -> 64)."""
    bits = x.to(tl.int32, bitcast=True)
    # Normal range: keep 3 of float32's 23 mantissa bits; the integer carry moves into the exponent.
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = kept.to(tl.float32, bitcast=True)
    subnormal = (x + SUBNORMAL_MAGIC) - SUBNORMAL_MAGIC
    # ... keeping the sign of a value that rounds to zero (as the cast does: -0.0).
    subnormal = (subnormal.to(tl.int32, bitcast=True) | (bits & -0x80000000)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < FP8_MIN_NORMAL, subnormal, normal)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, HEAD_DIM]
    value_ptr,  # [T, Hkv, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, HEAD_DIM], same strides as k_cache
    slot_mapping_ptr,  # [T] int64, block_id * BLOCK_SIZE + offset; negative: skip the token
    inv_k_scale,  # FP8: 1 / k_scale
    inv_v_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_ct,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,  # next power of 2 of NUM_KV_HEADS
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM (tl.arange's length); pad columns masked
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,  # the caches are float8 e4m3: scale and saturate
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, HEADS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    if HEAD_PAD == HEAD_DIM:  # no column mask in the code of power-of-2 head sizes
        mask = (offs_h < NUM_KV_HEADS)[:, None]
    else:
        mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct
    dst_offs = dst + offs_h[:, None] * stride_ch + offs_d[None, :]  # [HEADS_PAD, HEAD_PAD]
    k = tl.load(key_ptr + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if FP8:
        k = _round_to_e4m3(tl.clamp(k.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX))
        v = _round_to_e4m3(tl.clamp(v.to(tl.float32) * inv_v_scale, -FP8_MAX, FP8_MAX))
    tl.store(k_cache_ptr + dst_offs, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst_offs, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [T] int, block_id * block_size + offset
    k_scale: float = 1.0,  # FP8 caches: per-tensor scales
    v_scale: float = 1.0,
) -> None:
    """Stores token t's key and value in flat slot `slot_mapping[t]` of the caches, in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key.stride(-1) == 1 and value.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1], FP8=is_fp8(k_cache),
        num_warps=4,
    )  # fmt: skip


@triton.jit
def _copy_blocks_kernel(
    pool_ptr,  # [L * 2, num_blocks, BLOCK_NUMEL]: every layer's K and V pool
    src_ptr,  # [N] int64 source block ids
    dst_ptr,  # [N] int64 destination block ids
    stride_pool,  # elements from one (layer, K/V) pool to the next
    BLOCK_NUMEL: tl.constexpr,  # elements per block: block_size * Hkv * D
    CHUNK: tl.constexpr,  # elements per program
):
    pool = tl.program_id(0).to(tl.int64)
    pair = tl.program_id(1)
    chunk = tl.program_id(2)
    src = tl.load(src_ptr + pair).to(tl.int64)
    dst = tl.load(dst_ptr + pair).to(tl.int64)
    base = pool_ptr + pool * stride_pool
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < BLOCK_NUMEL
    data = tl.load(base + src * BLOCK_NUMEL + offs, mask=mask)
    tl.store(base + dst * BLOCK_NUMEL + offs, data, mask=mask)


def copy_blocks(
    pool: torch.Tensor,  # [L, 2, num_blocks, Hkv, block_size, D] contiguous, as in worker/kv_cache.py
    src: torch.Tensor,  # [N] int, on the pool's device
    dst: torch.Tensor,  # [N] int, distinct, none of them among `src`
) -> None:
    """Copy-on-write: block `dst[i]` becomes a copy of block `src[i]` in every layer, K and V, in one launch
    that reads each source block once and writes each destination once (PyTorch's index_select + index_copy_
    moves every byte twice, through a temporary). Programs run in any order, so unlike the gather-then-scatter
    PyTorch op a destination must not also be a source: true of copy-on-write, whose destinations are fresh
    blocks."""
    if src.numel() == 0:
        return
    pool = byte_view(pool)  # FP8 pools: bytes are bytes
    assert pool.is_contiguous() and src.shape == dst.shape
    num_layers, _, num_blocks = pool.shape[:3]
    flat = pool.view(num_layers * 2, num_blocks, -1)
    block_numel = flat.shape[-1]
    chunk = min(4096, triton.next_power_of_2(block_numel))
    grid = (num_layers * 2, src.numel(), triton.cdiv(block_numel, chunk))
    _copy_blocks_kernel[grid](
        flat, src.to(torch.int64), dst.to(torch.int64), flat.stride(0),
        BLOCK_NUMEL=block_numel, CHUNK=chunk, num_warps=4,
    )  # fmt: skip
