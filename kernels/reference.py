"""PyTorch reference of paged attention: what the CPU path runs and what the kernels are tested against.

KV cache layout, per layer: K and V pools, each `[num_blocks, block_size, num_kv_heads, head_dim]`. Token
`i` of a sequence lives in block `block_table[i // block_size]` at offset `i % block_size`; its flat slot
is `block_id * block_size + offset`. In memory the worker keeps each block head-major (`head_major`: one KV
head's tokens of a block are contiguous, which a kernel reading one KV head streams faster); everything here
and in the kernels reads a pool through its strides and takes either layout.

A batch is flattened: the query tokens of all sequences are concatenated, `query_start_loc[b]` is where
sequence `b`'s chunk starts and `seq_lens[b]` its context length after this step. The chunk is the END of
the context (positions `seq_len - q_len .. seq_len - 1`), which covers prefill, chunked prefill starting
part-way, and decode (q_len 1) in one call.

A layer may slide (`sliding_window` w > 0: a query at position p attends only the keys at positions
p - w + 1 .. p, as transformers' sliding-window mask) and soft-cap its scores (`softcap` c > 0: each scaled
score s becomes c * tanh(s / c) before the softmax, Gemma 2); 0 turns either off.

An FP8 cache (`torch.float8_e4m3fn`, half the bytes of bf16) holds each value divided by its pool's
per-tensor scale (`k_scale`, `v_scale`: what one unit of the stored number is worth), saturated at the
format's largest finite value; readers multiply back. Other caches store values as they are and ignore the
scales.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8_DTYPE).max  # 448: beyond it the cast would give NaN (e4m3fn has no infinity)


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_DTYPE


def byte_view(t: torch.Tensor) -> torch.Tensor:
    """An FP8 tensor's bytes as uint8 (the same memory), any other tensor as it is: copies of cached values
    move bytes, and PyTorch has no float8 kernels for some ops (index_copy_ on the CPU, for one)."""
    return t.view(torch.uint8) if is_fp8(t) else t


def quantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """`x` as stored in a cache of `dtype`: FP8 holds x / scale (rounded to nearest, saturated; computed as
    a product with the float32 reciprocal, as the kernel does), other dtypes hold x."""
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    return (x.float() * inv).clamp(-FP8_MAX, FP8_MAX).to(dtype)


def dequantize(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Cached values `x` back in `dtype` (FP8: times the scale)."""
    return x.to(dtype) * scale if x.dtype == FP8_DTYPE else x.to(dtype)


# Decode sequences are attended together; groups are split so the gathered K/V stay under this many tokens.
_DECODE_GROUP_TOKENS = 1 << 16


def head_major(blocks: torch.Tensor) -> torch.Tensor:
    """`[..., num_blocks, Hkv, block_size, D]` as laid out in memory -> the `[..., num_blocks, block_size,
    Hkv, D]` view every reader indexes."""
    return blocks.transpose(-3, -2)


def kv_pool(
    make: Callable[[tuple[int, ...]], torch.Tensor],
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    layout: str = "head",
) -> torch.Tensor:  # [num_blocks, block_size, Hkv, D]
    """A K or V pool whose blocks lie in memory "head"-major (the worker's) or "token"-major (contiguous as
    indexed); `make(shape)` allocates and fills the memory."""
    if layout == "token":
        return make((num_blocks, block_size, num_kv_heads, head_dim))
    assert layout == "head", layout
    return head_major(make((num_blocks, num_kv_heads, block_size, head_dim)))


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
    block_size = k_cache.shape[1]
    slots = slot_mapping.long()
    blocks, offsets = slots // block_size, slots % block_size  # indexing, not a flat view: any layout
    k_cache[blocks, offsets] = quantize(key, k_scale, k_cache.dtype)
    v_cache[blocks, offsets] = quantize(value, v_scale, v_cache.dtype)


def gather_kv(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int
    num_tokens: int,
) -> torch.Tensor:  # [B, num_tokens, Hkv, D]
    """The first `num_tokens` cached tokens of each sequence, in order, read through its block table."""
    block_size = cache.shape[1]
    num_blocks = -(-num_tokens // block_size)
    # Padding entries of a block table may hold anything; clamp so the gather stays in bounds (masked later).
    table = block_tables[:, :num_blocks].long().clamp(0, cache.shape[0] - 1)
    gathered = cache[table]  # [B, num_blocks, block_size, Hkv, D]
    return gathered.flatten(1, 2)[:, :num_tokens]


def _attend(
    query: torch.Tensor,  # [B, Lq, Hq, D]
    key: torch.Tensor,  # [B, Lk, Hkv, D]
    value: torch.Tensor,  # [B, Lk, Hkv, D]
    mask: torch.Tensor,  # [B, Lq, Lk] bool, True where attention is allowed
    scale: float,
    softcap: float = 0.0,
) -> torch.Tensor:  # [B, Lq, Hq, D]
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    if softcap <= 0:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=scale, enable_gqa=True)
        return out.transpose(1, 2)
    # Soft-capped scores: SDPA has no hook between the product and the softmax, so spelled out.
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = softcap * torch.tanh((q @ k.transpose(-1, -2)) * scale / softcap)  # [B, Hq, Lq, Lk]
    scores = scores.masked_fill(~mask[:, None], float("-inf"))
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, padded
    seq_lens: torch.Tensor,  # [B] int, context length after this step
    query_start_loc: torch.Tensor,  # [B + 1] int, cumulative query lengths
    scale: float,
    k_scale: float = 1.0,  # FP8 caches: per-tensor scales
    v_scale: float = 1.0,
    sliding_window: int = 0,  # > 0: each query sees only its last `sliding_window` positions
    softcap: float = 0.0,  # > 0: scores soft-capped to (-softcap, softcap)
) -> torch.Tensor:  # [T, Hq, D]
    """Causal attention of each sequence's query chunk to its cached context (the chunk's own K/V included,
    so `write_kv` must run first), within the sliding window if any. Each KV head serves Hq / Hkv
    consecutive query heads."""
    out = torch.empty_like(query)

    def gather(cache: torch.Tensor, tables: torch.Tensor, num_tokens: int, s: float) -> torch.Tensor:
        return dequantize(gather_kv(cache, tables, num_tokens), s, query.dtype)

    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[b + 1] - starts[b] for b in range(len(lens))]

    # Sequences with a multi-token chunk are attended one at a time: there are few of them per step and each
    # is large. Single-token chunks (decodes) are batched, with a mask for their different context lengths.
    for b in (b for b, n in enumerate(q_lens) if n > 1):
        q = query[starts[b] : starts[b + 1]]  # [q_len, Hq, D]
        k = gather(k_cache, block_tables[b : b + 1], lens[b], k_scale)
        v = gather(v_cache, block_tables[b : b + 1], lens[b], v_scale)
        q_pos = torch.arange(lens[b] - q_lens[b], lens[b], device=query.device)
        k_pos = torch.arange(lens[b], device=query.device)[None, :]
        mask = k_pos <= q_pos[:, None]  # [q_len, seq_len]
        if sliding_window > 0:
            mask &= k_pos > q_pos[:, None] - sliding_window
        out[starts[b] : starts[b + 1]] = _attend(q[None], k, v, mask[None], scale, softcap)[0]

    decodes = [b for b, n in enumerate(q_lens) if n == 1]
    i = 0
    while i < len(decodes):
        group = [decodes[i]]
        longest = lens[decodes[i]]
        i += 1
        while i < len(decodes) and (len(group) + 1) * max(longest, lens[decodes[i]]) <= _DECODE_GROUP_TOKENS:
            longest = max(longest, lens[decodes[i]])
            group.append(decodes[i])
            i += 1
        idx = torch.tensor(group, device=query.device)
        rows = query_start_loc[idx].long()  # [G] each decode's query row
        k = gather(k_cache, block_tables[idx], longest, k_scale)  # [G, longest, Hkv, D]
        v = gather(v_cache, block_tables[idx], longest, v_scale)
        k_pos = torch.arange(longest, device=query.device)[None, :]
        ends = seq_lens[idx].to(query.device)[:, None]
        mask = k_pos < ends
        if sliding_window > 0:
            mask &= k_pos >= ends - sliding_window
        out[rows] = _attend(query[rows][:, None], k, v, mask[:, None], scale, softcap)[:, 0]
    return out
