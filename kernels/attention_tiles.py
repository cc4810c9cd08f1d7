"""The Triton building blocks of paged attention: online softmax over K/V tiles read through a block table,
decode's speculative and register-prefetched tile loops, and the in-launch combine of split-KV partials.

`kernels/triton_attention.py` holds the kernel that calls them and its launcher; `kernels/reference.py` is
the PyTorch reference both are tested against (`tests/kernels/`). Pointers carry their shapes in comments;
the caches are `[num_blocks, BLOCK_SIZE, Hkv, HEAD_DIM]`, read through their strides.

Two features of a layer are compile-time flags whose code is absent when off (the default): SLIDING (each
query sees only the keys above its position minus `window`; the caller starts the tile loops at the
window's first tile, so tiles wholly outside it are never read) and SOFTCAP (scores soft-capped: the
launcher folds 1 / softcap into `qk_scale` and passes `softcap_log2` = softcap * log2(e)).

Head sizes that are not a power of 2 (Phi-3's 96, 80, 112, ...) are computed on tiles of HEAD_PAD columns, the
next power of 2 (what `tl.arange` takes): the columns from HEAD_DIM on load as zeros (they add nothing to
q.k) and are never stored. The cache keeps rows of exactly HEAD_DIM values. With HEAD_PAD == HEAD_DIM the
column masks are absent from the code (`load_rows`, `store_rows`), so power-of-2 head sizes compile as before.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_rows(
    ptrs, rows_ok, MASK_ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    EVICT: tl.constexpr,  # eviction_policy of the load ("" or "evict_first")
):  # fmt: skip
    """[R, HEAD_PAD] values at `ptrs` (rows of HEAD_DIM values, their pointers padded to HEAD_PAD columns):
    zero in the pad columns and, with MASK_ROWS, in the rows where `rows_ok` [R] is false. Without padding the
    column mask is not generated at all."""
    if HEAD_PAD == HEAD_DIM:
        if MASK_ROWS:
            x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0, eviction_policy=EVICT)
        else:
            x = tl.load(ptrs, eviction_policy=EVICT)
    else:
        cols_ok = (tl.arange(0, HEAD_PAD) < HEAD_DIM)[None, :]
        if MASK_ROWS:
            x = tl.load(ptrs, mask=rows_ok[:, None] & cols_ok, other=0.0, eviction_policy=EVICT)
        else:
            x = tl.load(ptrs, mask=cols_ok, other=0.0, eviction_policy=EVICT)
    return x


@triton.jit
def store_rows(ptrs, x, rows_ok, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr):
    """Stores the rows of `x` [R, HEAD_PAD] where `rows_ok` [R], their first HEAD_DIM columns only."""
    if HEAD_PAD == HEAD_DIM:
        tl.store(ptrs, x, mask=rows_ok[:, None])
    else:
        tl.store(ptrs, x, mask=rows_ok[:, None] & (tl.arange(0, HEAD_PAD) < HEAD_DIM)[None, :])


@triton.jit
def _softmax_step(acc, l_i, m_i, s, v, IEEE_DOT: tl.constexpr):
    """One tile of online softmax: scores s [BLOCK_M, TILE_N] (log2 units, -inf where masked) and values v
    [TILE_N, HEAD_PAD] into the running (acc, l, m)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing visible yet keeps m = -inf; shift by 0 so that exp2 gives 0, never NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE_DOT:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return acc * alpha[:, None] + pv, l_i, m_new


@triton.jit
def _scores(q, k, qk_scale, softcap_log2, IEEE_DOT: tl.constexpr, SOFTCAP: tl.constexpr):
    """[BLOCK_M, TILE_N] scores of the rows q against the tile's keys k, in log2 units; with SOFTCAP
    softcap * tanh(q.k * scale / softcap) (qk_scale then holds scale / softcap)."""
    if IEEE_DOT:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = s * qk_scale
    if SOFTCAP:
        # tanh(s) = 1 - 2 / (e^(2s) + 1): exact at both ends (e^(2s) = inf or 0), no libdevice call (which
        # the interpreter lacks).
        s = (1.0 - 2.0 / (tl.exp2(s * 2.8853900817779268) + 1.0)) * softcap_log2
    return s


@triton.jit
def _kv_offsets(
    block, pos, kv_head, stride_cb, stride_ct, stride_ch, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    """[TILE_N, HEAD_PAD] element offsets of one KV head's K (or V) at context positions `pos` (the pad
    columns' offsets run into the next head: `load_rows` masks them)."""
    row = block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_ct + kv_head * stride_ch
    return row[:, None] + tl.arange(0, HEAD_PAD)[None, :]


@triton.jit
def attend_tiles(
    acc,  # [BLOCK_M, HEAD_PAD] fp32 running output (unnormalized)
    l_i,  # [BLOCK_M] fp32 running sum of exponentials
    m_i,  # [BLOCK_M] fp32 running max score, log2 units
    q,  # [BLOCK_M, HEAD_PAD] the program's query rows
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, HEAD_DIM]
    table_ptr,  # [max_blocks] int32, this sequence's block table row
    kv_head,
    q_pos,  # [BLOCK_M] context position of each row's query token
    kv_len,  # tokens of context the program may read
    qk_scale,  # softmax scale * log2(e)
    tile_lo,
    tile_hi,
    stride_cb,
    stride_ct,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM: the tiles' columns
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,  # False only for tiles wholly inside every row's causal (and sliding) window
    IEEE_DOT: tl.constexpr,  # float32 caches: exact float32 products instead of tf32
    window=0,  # SLIDING: a row at position p sees the keys above p - window
    softcap_log2=1.0,  # SOFTCAP: softcap * log2(e)
    SLIDING: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    offs_n = tl.arange(0, TILE_N)
    for t in range(tile_lo, tile_hi):
        pos = t * TILE_N + offs_n  # [TILE_N] context positions of the tile
        in_ctx = pos < kv_len
        if MASKED:
            block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_ctx, other=0)
        else:
            block = tl.load(table_ptr + pos // BLOCK_SIZE)
        kv_offs = _kv_offsets(block, pos, kv_head, stride_cb, stride_ct, stride_ch, HEAD_PAD, BLOCK_SIZE)
        k = load_rows(k_cache_ptr + kv_offs, in_ctx, MASKED, HEAD_DIM, HEAD_PAD, "")
        v = load_rows(v_cache_ptr + kv_offs, in_ctx, MASKED, HEAD_DIM, HEAD_PAD, "")
        k, v = k.to(q.dtype), v.to(q.dtype)  # FP8 caches: the scales are folded into qk_scale and the output
        s = _scores(q, k, qk_scale, softcap_log2, IEEE_DOT, SOFTCAP)  # [BLOCK_M, TILE_N]
        if MASKED:
            visible = in_ctx[None, :] & (pos[None, :] <= q_pos[:, None])
            if SLIDING:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        acc, l_i, m_i = _softmax_step(acc, l_i, m_i, s, v, IEEE_DOT)
    return acc, l_i, m_i


@triton.jit
def _speculative_block_ids(table_ptr, pos, max_blocks, num_blocks, BLOCK_SIZE: tl.constexpr):
    """Block ids of context positions `pos`, loaded before the sequence length is known: past the context a
    block-table row holds anything, so the entry index and the block id are clamped in bounds."""
    block = tl.load(table_ptr + tl.minimum(pos // BLOCK_SIZE, max_blocks - 1))
    return tl.minimum(tl.maximum(block, 0), num_blocks - 1)


@triton.jit
def _decode_tile_math(
    acc, l_i, m_i, q, k, v, in_ctx, qk_scale, softcap_log2, IEEE_DOT: tl.constexpr, ZERO_V: tl.constexpr,
    SOFTCAP: tl.constexpr,
):  # fmt: skip
    """One decode tile's scores and online-softmax step. The scores of slots outside the context (`in_ctx`
    false) are masked; ZERO_V zeroes their values too, for tiles whose loads were not masked (speculative):
    such slots may hold anything, even NaN, and NaN * 0 is NaN."""
    k = k.to(q.dtype)  # FP8 caches: the scales are folded into qk_scale and the output
    v = v.to(q.dtype)
    if ZERO_V:
        v = tl.where(in_ctx[:, None], v, 0.0)
    s = _scores(q, k, qk_scale, softcap_log2, IEEE_DOT, SOFTCAP)
    s = tl.where(in_ctx[None, :], s, float("-inf"))  # [BLOCK_M, TILE_N]
    return _softmax_step(acc, l_i, m_i, s, v, IEEE_DOT)


@triton.jit
def _in_window(pos, seq_len, kv_lo, SLIDING: tl.constexpr):
    """Which of the decode token's context positions `pos` it sees: below seq_len and, SLIDING, from kv_lo."""
    in_ctx = pos < seq_len
    if SLIDING:
        in_ctx = in_ctx & (pos >= kv_lo)
    return in_ctx


@triton.jit
def attend_decode_tile(
    acc,  # [BLOCK_M, HEAD_PAD] fp32 running output (unnormalized)
    l_i,  # [BLOCK_M] fp32 running sum of exponentials
    m_i,  # [BLOCK_M] fp32 running max score, log2 units
    q,  # [BLOCK_M, HEAD_PAD] the query heads of one KV group, one token
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,  # [max_blocks] int32, this sequence's block table row
    t,  # the tile
    kv_head,
    seq_len,  # tokens of context; the decode token is the last, so it sees all of them
    qk_scale,
    max_blocks,  # entries in a block-table row
    num_blocks,  # blocks in the cache
    stride_cb,
    stride_ct,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM: the tiles' columns
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    SPECULATIVE: tl.constexpr,  # load without waiting for seq_len: indices clamped in bounds, V zeroed after
    IEEE_DOT: tl.constexpr,
    kv_lo=0,  # SLIDING: the first position in the window (seq_len - window)
    softcap_log2=1.0,  # SOFTCAP: softcap * log2(e)
    SLIDING: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """One K/V tile of a decode token's context. K/V are read by this program only, so they are loaded
    evict-first (they would only push the split partials and block tables out of the L2)."""
    pos = t * TILE_N + tl.arange(0, TILE_N)
    in_ctx = _in_window(pos, seq_len, kv_lo, SLIDING)
    if SPECULATIVE:
        block = _speculative_block_ids(table_ptr, pos, max_blocks, num_blocks, BLOCK_SIZE)
        kv_offs = _kv_offsets(block, pos, kv_head, stride_cb, stride_ct, stride_ch, HEAD_PAD, BLOCK_SIZE)
        k = load_rows(k_cache_ptr + kv_offs, in_ctx, False, HEAD_DIM, HEAD_PAD, "evict_first")
        v = load_rows(v_cache_ptr + kv_offs, in_ctx, False, HEAD_DIM, HEAD_PAD, "evict_first")
    else:
        block = tl.load(table_ptr + pos // BLOCK_SIZE, mask=in_ctx, other=0)
        kv_offs = _kv_offsets(block, pos, kv_head, stride_cb, stride_ct, stride_ch, HEAD_PAD, BLOCK_SIZE)
        k = load_rows(k_cache_ptr + kv_offs, in_ctx, True, HEAD_DIM, HEAD_PAD, "evict_first")
        v = load_rows(v_cache_ptr + kv_offs, in_ctx, True, HEAD_DIM, HEAD_PAD, "evict_first")
    return _decode_tile_math(
        acc, l_i, m_i, q, k, v, in_ctx, qk_scale, softcap_log2, IEEE_DOT, SPECULATIVE, SOFTCAP
    )


@triton.jit
def attend_decode_tiles_prefetched(
    acc,
    l_i,
    m_i,
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_ptr,
    first_tile,  # this program's tiles: first_tile, first_tile + step, ... below num_tiles
    step,
    num_tiles,
    kv_head,
    seq_len,
    qk_scale,
    max_blocks,
    num_blocks,
    stride_cb,
    stride_ct,
    stride_ch,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM: the tiles' columns
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    IEEE_DOT: tl.constexpr,
    kv_lo=0,  # SLIDING: the first position in the window
    softcap_log2=1.0,  # SOFTCAP: softcap * log2(e)
    SLIDING: tl.constexpr = False,
    SOFTCAP: tl.constexpr = False,
):
    """All of a decode program's tiles, each one's K/V requested into registers before the math of the one
    before it, and its block-table entries one tile earlier still. The first tile's K/V and the second's
    entries load speculatively (before seq_len is known); later loads are masked to the context."""
    offs_n = tl.arange(0, TILE_N)
    pos = first_tile * TILE_N + offs_n
    block = _speculative_block_ids(table_ptr, pos, max_blocks, num_blocks, BLOCK_SIZE)
    kv_offs = _kv_offsets(block, pos, kv_head, stride_cb, stride_ct, stride_ch, HEAD_PAD, BLOCK_SIZE)
    k = load_rows(k_cache_ptr + kv_offs, pos, False, HEAD_DIM, HEAD_PAD, "evict_first")
    v = load_rows(v_cache_ptr + kv_offs, pos, False, HEAD_DIM, HEAD_PAD, "evict_first")
    next_block = _speculative_block_ids(table_ptr, pos + step * TILE_N, max_blocks, num_blocks, BLOCK_SIZE)
    for t in range(first_tile, num_tiles, step):
        pos = t * TILE_N + offs_n
        next_pos = pos + step * TILE_N
        next_in_ctx = next_pos < seq_len
        kv_offs = _kv_offsets(
            next_block, next_pos, kv_head, stride_cb, stride_ct, stride_ch, HEAD_PAD, BLOCK_SIZE
        )
        next_k = load_rows(k_cache_ptr + kv_offs, next_in_ctx, True, HEAD_DIM, HEAD_PAD, "evict_first")
        next_v = load_rows(v_cache_ptr + kv_offs, next_in_ctx, True, HEAD_DIM, HEAD_PAD, "evict_first")
        after_pos = next_pos + step * TILE_N
        next_block = tl.load(table_ptr + after_pos // BLOCK_SIZE, mask=after_pos < seq_len, other=0)
        in_ctx = _in_window(pos, seq_len, kv_lo, SLIDING)
        acc, l_i, m_i = _decode_tile_math(
            acc, l_i, m_i, q, k, v, in_ctx, qk_scale, softcap_log2, IEEE_DOT, True, SOFTCAP
        )
        k = next_k
        v = next_v
    return acc, l_i, m_i


@triton.jit
def combine_group(
    out_ptr,  # [T, Hq, HEAD_DIM]
    part_acc_ptr,  # [T, Hq, SPLITS, HEAD_DIM] fp32
    part_ml_ptr,  # [T, Hq, SPLITS, 2] fp32
    row,  # the decode token (= sequence) whose GROUP heads are combined
    first_head,  # kv_head * GROUP
    num_heads,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,  # next power of 2 of GROUP
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,  # splits merged per step, a power of 2
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM
):
    """Merges the SPLITS partial results of one token's GROUP query heads and writes the output. The loads
    bypass L1 (.cg): the other splits wrote them from other multiprocessors during this launch."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_PAD)
    g_ok = offs_g < GROUP
    head_row = row.to(tl.int64) * num_heads + first_head + offs_g  # [GROUP_PAD]
    m_run = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_run = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_PAD], dtype=tl.float32)
    for c in tl.static_range(0, SPLITS, CHUNK):
        s_ok = g_ok[:, None] & (c + offs_c[None, :] < SPLITS)  # [GROUP_PAD, CHUNK]
        part = head_row[:, None] * SPLITS + c + offs_c[None, :]
        m = tl.load(part_ml_ptr + part * 2, mask=s_ok, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=s_ok, other=0.0, cache_modifier=".cg")
        if HEAD_PAD == HEAD_DIM:
            a_ok = s_ok[:, :, None]
        else:
            a_ok = s_ok[:, :, None] & (offs_d < HEAD_DIM)[None, None, :]
        a = tl.load(
            part_acc_ptr + part[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=a_ok, other=0.0, cache_modifier=".cg",
        )  # fmt: skip
        m_new = tl.maximum(m_run, tl.max(m, 1))
        # Empty splits (and padding) have m = -inf and weigh 0; shift by 0 while every one so far is empty.
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2(m - m_shift[:, None])
        alpha = tl.exp2(m_run - m_shift)
        l_run = l_run * alpha + tl.sum(l_s * w, 1)
        acc = acc * alpha[:, None] + tl.sum(a * w[:, :, None], 1)
        m_run = m_new
    out = acc / l_run[:, None]
    out_offs = row.to(tl.int64) * stride_ot + (first_head + offs_g)[:, None] * stride_oh + offs_d[None, :]
    store_rows(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), g_ok, HEAD_DIM, HEAD_PAD)
