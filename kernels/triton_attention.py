"""Triton paged attention over block tables: decode, prefill, chunked prefill and mixed batches in one kernel.

Same contract as `kernels.reference.paged_attention` (the PyTorch reference the tests compare against): the
query tokens of all sequences are flattened, `query_start_loc` delimits each sequence's chunk, the chunk is
the END of the sequence's context of `seq_lens[b]` tokens, and the chunk's own keys/values are already in the
cache (`cache_ops.write_kv` runs first).

One program handles BLOCK_Q consecutive query tokens of one sequence times the GROUP query heads that share
one KV head: BLOCK_M = BLOCK_Q * GROUP rows. Each K/V tile is loaded once for the whole group and used by
`tl.dot`, so GQA/MQA read the cache once per KV head. Decode batches use BLOCK_Q = 1 (rows padded to 16
for `tl.dot`); prefill uses up to 128 rows. For few sequences with long contexts the KV range is split
over several programs ("flash decoding"). In decode batches the last split program of each (sequence, KV
head) to finish, found through an atomic counter, combines the partial results in the same launch; prefill
and mixed batches with splits (only when asked for) combine them in a second kernel. A mixed batch's
leading decodes (given as `num_decode_seqs`) take the decode path, in a launch of their own.

Per layer, a sliding window (SLIDING: a query at position p sees the keys p - window + 1 .. p) and score
soft-capping (SOFTCAP) are compile-time features, absent from the code of layers without them. A sliding
layer's programs start their tile loops at the window's first tile: the blocks before it are never read.

Any head size that is a multiple of 8 up to 256 (Phi-3-mini's 96, 80, 112, ...): the kernels compute on tiles
padded to the next power of 2 (`padded_head_dim`), with the pad columns masked on every load and store, so
the cache keeps exactly head_dim values per token; the tiles and split counts are those of the padded size.
At a power of 2 the masks are not in the compiled code.

The tiles and split counts come from `kernels/attention_config.py`; the jitted helpers the kernel calls (tile
loops, the in-launch combine) from `kernels/attention_tiles.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention_config import (
    FP8_DOTS_IN_FP16,
    AttentionConfig,
    choose_num_splits,
    decode_config,
    padded_head_dim,
    prefill_config,
)
from pagedserve.kernels.attention_tiles import (
    attend_decode_tile,
    attend_decode_tiles_prefetched,
    attend_tiles,
    combine_group,
    load_rows,
    store_rows,
)
from pagedserve.kernels.reference import is_fp8


# Arguments that change from call to call: not specialized (on divisibility by 16, or == 1), which would
# compile new variants in the middle of a serving run.
@triton.jit(
    do_not_specialize=["num_seqs", "num_splits", "max_blocks", "stride_bt", "first_program", "window"]
)
def _paged_attention_kernel(
    out_ptr,  # [T, Hq, HEAD_DIM], written unless SPLIT_KV
    part_acc_ptr,  # [T, Hq, num_splits, HEAD_DIM] fp32 unnormalized partial outputs (SPLIT_KV)
    part_ml_ptr,  # [T, Hq, num_splits, 2] fp32 partial max score (log2 units) and sum of exponentials
    counter_ptr,  # [B * Hkv] int32, zero between calls: splits done per (sequence, KV head) (FUSED_SPLITS)
    query_ptr,  # [T, Hq, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, Hkv, HEAD_DIM], same strides as k_cache
    block_tables_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32, context length after this step
    query_start_loc_ptr,  # [B + 1] int32
    num_seqs,
    num_splits,
    qk_scale,  # softmax scale * log2(e) (SOFTCAP: scale / softcap), times k_scale for FP8 caches
    v_scale,  # FP8 caches: the V pool's scale, applied to the output (1.0 otherwise)
    max_blocks,  # block_tables.shape[1]
    num_blocks,  # k_cache.shape[0]
    first_program,  # not DECODE_ONLY: program index of the first sequence's first query block
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_ct,
    stride_ch,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM: the tiles' columns (kernels/attention_tiles.py)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # query tokens per program; BLOCK_Q * GROUP <= BLOCK_M
    TILE_N: tl.constexpr,
    SPLIT_KV: tl.constexpr,  # num_splits > 1: write partial results for _combine_splits_kernel
    DECODE_ONLY: tl.constexpr,  # every chunk is one token: the index on grid axis 0 is the sequence
    IEEE_DOT: tl.constexpr,
    DOTS_FP16: tl.constexpr = False,  # FP8 caches: the query (and so K, V and the products) in fp16
    FUSED_SPLITS: tl.constexpr = 0,  # > 0 (= num_splits, DECODE_ONLY): the last split combines in place
    GROUP_PAD: tl.constexpr = 1,  # next power of 2 of GROUP (FUSED_SPLITS)
    COMBINE_CHUNK: tl.constexpr = 1,  # splits merged per step by combine_group (FUSED_SPLITS)
    REGISTER_PREFETCH: tl.constexpr = False,  # DECODE_ONLY: attend_decode_tiles_prefetched
    window=0,  # SLIDING: tokens each query sees, itself included
    softcap_log2=1.0,  # SOFTCAP: softcap * log2(e)
    SLIDING: tl.constexpr = False,  # a sliding-window layer
    SOFTCAP: tl.constexpr = False,  # scores soft-capped: softcap * tanh(score / softcap)
):
    if DECODE_ONLY:
        pid_q = tl.program_id(0)
    else:
        # Later query blocks of a sequence see more context: start them first, so short ones fill the tail.
        pid_q = first_program + tl.num_programs(0) - 1 - tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_heads = tl.num_programs(1) * GROUP

    if DECODE_ONLY:
        seq = pid_q
        q_block = 0
    else:
        # Sequence b owns programs first(b) .. first(b) + cdiv(q_len_b, BLOCK_Q) - 1 with
        # first(b) = query_start_loc[b] // BLOCK_Q + b, which is strictly increasing: binary search for pid_q.
        lo = 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(first <= pid_q, mid, lo)
            hi = tl.where(first <= pid_q, hi, mid - 1)
        seq = lo
        q_block = pid_q - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq)

    if DECODE_ONLY:
        q_start = seq  # one token per sequence: one dependent load fewer before the cache reads
        q_len = 1
    else:
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_block * BLOCK_Q >= q_len:
            return  # a gap between two sequences' programs
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_start = seq_len - q_len  # context position of the chunk's first token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    tok = q_block * BLOCK_Q + offs_m // GROUP  # [BLOCK_M] token index within the chunk
    head = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M] query head
    row_ok = (tok < q_len) & (offs_m < BLOCK_Q * GROUP)
    q_pos = ctx_start + tok
    q_row = (q_start + tok).to(tl.int64)
    q_ptrs = query_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = load_rows(q_ptrs, row_ok, True, HEAD_DIM, HEAD_PAD, "")  # pad columns 0: q.k exact
    if DOTS_FP16:
        q = q.to(tl.float16)  # K and V follow the query's dtype

    first_pos = ctx_start + q_block * BLOCK_Q  # smallest query position among the rows
    kv_len = ctx_start + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)  # the last row sees this many tokens
    num_tiles = tl.cdiv(kv_len, TILE_N)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if DECODE_ONLY:
        # The tiles go round-robin to the splits (split s reads tiles s, s + num_splits, ...), so the first
        # tile of every program is known before seq_len is: it loads speculatively, in parallel with seq_len
        # (one dependent load less before the K/V bytes stream); positions past the context are masked.
        # A sliding layer's tiles start at the window's first one (after seq_len, so not speculatively).
        if FUSED_SPLITS > 0:
            step = FUSED_SPLITS
        else:
            step = num_splits
        if SLIDING:
            kv_lo = tl.maximum(kv_len - window, 0)
            first_tile = split + kv_lo // TILE_N
        else:
            kv_lo = 0
            first_tile = split
        if REGISTER_PREFETCH:
            acc, l_i, m_i = attend_decode_tiles_prefetched(
                acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, first_tile, step, num_tiles, kv_head,
                kv_len, qk_scale, max_blocks, num_blocks, stride_cb, stride_ct, stride_ch,
                HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, IEEE_DOT, kv_lo, softcap_log2, SLIDING, SOFTCAP,
            )  # fmt: skip
        else:
            acc, l_i, m_i = attend_decode_tile(
                acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, first_tile, kv_head, kv_len, qk_scale,
                max_blocks, num_blocks, stride_cb, stride_ct, stride_ch, HEAD_DIM, HEAD_PAD, BLOCK_SIZE,
                TILE_N, True, IEEE_DOT, kv_lo, softcap_log2, SLIDING, SOFTCAP,
            )  # fmt: skip
            for t in range(first_tile + step, num_tiles, step):
                acc, l_i, m_i = attend_decode_tile(
                    acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, t, kv_head, kv_len, qk_scale,
                    max_blocks, num_blocks, stride_cb, stride_ct, stride_ch, HEAD_DIM, HEAD_PAD, BLOCK_SIZE,
                    TILE_N, False, IEEE_DOT, kv_lo, softcap_log2, SLIDING, SOFTCAP,
                )  # fmt: skip
    else:
        if SLIDING:  # the first tile holding a key in the first row's window (clamped: // of a negative)
            tile_start = tl.maximum(first_pos - window + 1, 0) // TILE_N
        else:
            tile_start = 0
        if SPLIT_KV:
            per_split = tl.cdiv(num_tiles - tile_start, num_splits)
            tile_lo = tile_start + split * per_split
            tile_hi = tl.minimum(tile_lo + per_split, num_tiles)
        else:
            tile_lo = tile_start
            tile_hi = num_tiles
        # Tiles ending at or before first_pos are visible to every row: no mask needed there.
        full_hi = tl.maximum(tile_lo, tl.minimum(tile_hi, (first_pos + 1) // TILE_N))
        if SLIDING:
            # ... and, sliding, only from the first tile inside the last row's window too; before it masked.
            full_lo = tl.minimum(
                tl.maximum(tile_lo, tl.cdiv(tl.maximum(kv_len - window, 0), TILE_N)), full_hi
            )
            acc, l_i, m_i = attend_tiles(
                acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, q_pos, kv_len, qk_scale,
                tile_lo, full_lo, stride_cb, stride_ct, stride_ch, HEAD_DIM, HEAD_PAD,
                BLOCK_SIZE, TILE_N, True, IEEE_DOT, window, softcap_log2, SLIDING, SOFTCAP,
            )  # fmt: skip
        else:
            full_lo = tile_lo
        acc, l_i, m_i = attend_tiles(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, q_pos, kv_len, qk_scale,
            full_lo, full_hi, stride_cb, stride_ct, stride_ch,
            HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, False, IEEE_DOT, window, softcap_log2, False, SOFTCAP,
        )  # fmt: skip
        acc, l_i, m_i = attend_tiles(
            acc, l_i, m_i, q, k_cache_ptr, v_cache_ptr, table_ptr, kv_head, q_pos, kv_len, qk_scale,
            full_hi, tile_hi, stride_cb, stride_ct, stride_ch,
            HEAD_DIM, HEAD_PAD, BLOCK_SIZE, TILE_N, True, IEEE_DOT, window, softcap_log2, SLIDING, SOFTCAP,
        )  # fmt: skip

    acc = acc * v_scale
    if SPLIT_KV:
        part = (q_row * num_heads + head) * num_splits + split  # [BLOCK_M]
        part_ptrs = part_acc_ptr + part[:, None] * HEAD_DIM + offs_d[None, :]
        store_rows(part_ptrs, acc, row_ok, HEAD_DIM, HEAD_PAD)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)
        if FUSED_SPLITS > 0:
            # The last of the sequence's splits for this KV head to get here combines them all. Every thread's
            # stores above are ordered before the counter's release by the barrier; the acquire makes the
            # other splits' stores visible to the last one. It resets the counter for the next call (or
            # graph replay), so the counters stay zero between calls.
            tl.debug_barrier()
            counter = counter_ptr + seq * tl.num_programs(1) + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == FUSED_SPLITS - 1:
                tl.store(counter, 0)
                combine_group(
                    out_ptr, part_acc_ptr, part_ml_ptr, seq, kv_head * GROUP, num_heads, stride_ot, stride_oh,
                    GROUP, GROUP_PAD, FUSED_SPLITS, COMBINE_CHUNK, HEAD_DIM, HEAD_PAD,
                )  # fmt: skip
    else:
        out = acc / l_i[:, None]
        out_offs = q_row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        store_rows(out_ptr + out_offs, out.to(out_ptr.dtype.element_ty), row_ok, HEAD_DIM, HEAD_PAD)


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, Hq, HEAD_DIM]
    part_acc_ptr,  # [T, Hq, num_splits, HEAD_DIM] fp32
    part_ml_ptr,  # [T, Hq, num_splits, 2] fp32
    num_splits,
    stride_ot,
    stride_oh,
    SPLITS_PAD: tl.constexpr,  # next power of 2 of num_splits
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # next power of 2 of HEAD_DIM
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * tl.num_programs(1) + h) * num_splits
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    ok = offs_s < num_splits
    m = tl.load(part_ml_ptr + (base + offs_s) * 2, mask=ok, other=float("-inf"))
    l_s = tl.load(part_ml_ptr + (base + offs_s) * 2 + 1, mask=ok, other=0.0)
    part_ptrs = part_acc_ptr + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :]  # [SPLITS_PAD, HEAD_PAD]
    acc = load_rows(part_ptrs, ok, True, HEAD_DIM, HEAD_PAD, "")
    # Split 0 always holds tokens, so m_max is finite; empty splits (m = -inf) get weight 0.
    w = tl.exp2(m - tl.max(m, 0))
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l_s * w, 0)
    out_ptrs = out_ptr + t * stride_ot + h * stride_oh + offs_d
    if HEAD_PAD == HEAD_DIM:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least n counters for the fused split combine, kept per device: the kernel
    leaves it zero after every call, so the same buffer serves every later call and CUDA-graph replay. Grown
    (a new zeroed buffer) when a call needs more; warm-up calls before a graph capture allocate it outside
    the graph. Concurrent calls on different streams must not share it (they would share counters)."""
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.zeros(max(n, 1024), dtype=torch.int32, device=device)
        _counters[device] = buf
    return buf


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32, context length after this step
    query_start_loc: torch.Tensor,  # [B + 1] int32
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    num_splits: int | None = None,
    config: AttentionConfig | None = None,
    out: torch.Tensor | None = None,  # [T, Hq, D], written in full; allocated when None
    num_decode_seqs: int = 0,
    k_scale: float = 1.0,  # FP8 caches (float8_e4m3fn): per-tensor scales, as `kernels.reference` says
    v_scale: float = 1.0,
    sliding_window: int = 0,  # > 0: the layer's window, as `kernels.reference` says; 0: global
    softcap: float = 0.0,  # > 0: scores soft-capped to (-softcap, softcap); 0: off
) -> torch.Tensor:  # [T, Hq, D]
    """Causal paged attention of each sequence's query chunk to its cached context.

    `max_query_len` and `max_seq_len` are host-side bounds (no device sync, so the call can be captured in
    a CUDA graph): max_query_len == 1 selects the decode path, where `num_splits` (chosen automatically
    when None) splits each sequence's context over several programs. In a mixed batch whose first
    `num_decode_seqs` sequences have one query token each (the scheduler puts decodes first), those go down
    the decode path and the rest down the unified one, whose tiles of up to 128 query rows would otherwise
    carry one decode token's 1-8 rows through its whole context (docs/kernels.md has the measurement).
    `num_splits` then applies to the rest. An FP8 cache is read as bytes and converted to the query's dtype
    in registers (half the bytes of a bf16 cache); its scales fold into the softmax scale and the output.
    `config` (default: `decode_config` / `prefill_config` for the path) sets the tiles and, for decode
    splits, where they are combined (`AttentionConfig.combine`). `sliding_window` and `softcap` are a
    layer's constants (compile-time features of the kernel); a sliding layer reads only the KV tiles that
    meet its window, and its automatic split count follows the window, not the whole context.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = block_tables.shape[0]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    head_pad = padded_head_dim(head_dim)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and query.stride(-1) == 1
    assert block_tables.stride(-1) == 1
    assert k_cache.dtype == v_cache.dtype
    if not is_fp8(k_cache):
        k_scale = v_scale = 1.0  # values are stored as they are
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0:
        return out

    decode_only = max_query_len == 1 and num_tokens == num_seqs
    first_seq = 0  # the unified path's first sequence
    if not decode_only and 0 < num_decode_seqs < num_seqs:
        first_seq = num_decode_seqs  # = its tokens: one each
        paged_attention(
            query[:first_seq], k_cache, v_cache, block_tables[:first_seq], seq_lens[:first_seq],
            query_start_loc[: first_seq + 1], scale, 1, max_seq_len, out=out[:first_seq],
            k_scale=k_scale, v_scale=v_scale, sliding_window=sliding_window, softcap=softcap,
        )  # fmt: skip
    assert not decode_only or block_tables.shape[1] > 0, "decode needs a block-table entry per sequence"
    if decode_only:
        if num_splits is None:
            read_len = min(max_seq_len, sliding_window) if sliding_window > 0 else max_seq_len
            num_splits = choose_num_splits(query.device, num_seqs, num_kv_heads, read_len, head_pad)
        cfg = config or decode_config(head_pad, is_fp8(k_cache), split=num_splits > 1)
        block_m = max(cfg.block_m, triton.next_power_of_2(group))
        block_q = 1
        num_q_programs = num_seqs
        first_program = 0
    else:
        cfg = config or prefill_config(head_pad, is_fp8(k_cache))
        # Short chunks (a mixed batch of decodes and small chunks) get fewer, mostly useful rows.
        block_m = max(16, min(cfg.block_m, triton.next_power_of_2(max_query_len * group)))
        block_m = max(block_m, triton.next_power_of_2(group))
        block_q = block_m // group
        num_splits = num_splits or 1
        # Sequence b's programs start at query_start_loc[b] // block_q + b (b counted from first_seq).
        first_program = first_seq // block_q
        num_q_programs = num_tokens // block_q + num_seqs - first_seq - first_program

    if num_splits > 1:
        part_acc = torch.empty(
            num_tokens, num_heads, num_splits, head_dim, device=query.device, dtype=torch.float32
        )
        part_ml = torch.empty(num_tokens, num_heads, num_splits, 2, device=query.device, dtype=torch.float32)
    else:
        part_acc = part_ml = out  # unused
    fused = decode_only and num_splits > 1 and cfg.combine == "fused"
    counters = _split_counters(query.device, num_seqs * num_kv_heads) if fused else seq_lens  # else unused
    group_pad = triton.next_power_of_2(group)
    # Splits merged per step by the last split: about 8k fp32 partial-output elements in registers at a time.
    combine_chunk = max(2, min(triton.next_power_of_2(num_splits), 8192 // (group_pad * head_pad)))
    # From first_seq on (rows of the query and output stay absolute, through query_start_loc).
    tables, lens, starts = block_tables[first_seq:], seq_lens[first_seq:], query_start_loc[first_seq:]
    grid = (num_q_programs, num_kv_heads, num_splits)
    log2e = 1.4426950408889634
    qk_scale = scale * k_scale * (1.0 / softcap if softcap > 0 else log2e)
    _paged_attention_kernel[grid](
        out, part_acc, part_ml, counters, query, k_cache, v_cache, tables, lens, starts,
        num_seqs - first_seq, num_splits, qk_scale, v_scale, tables.shape[1],
        k_cache.shape[0],
        first_program, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_Q=block_q,
        TILE_N=cfg.tile_n, SPLIT_KV=num_splits > 1, DECODE_ONLY=decode_only,
        IEEE_DOT=query.dtype == torch.float32,
        DOTS_FP16=FP8_DOTS_IN_FP16 and is_fp8(k_cache) and query.dtype != torch.float32,
        FUSED_SPLITS=num_splits if fused else 0, GROUP_PAD=group_pad if fused else 1,
        COMBINE_CHUNK=combine_chunk if fused else 1, REGISTER_PREFETCH=decode_only and cfg.register_prefetch,
        window=sliding_window, softcap_log2=softcap * log2e if softcap > 0 else 1.0,
        SLIDING=sliding_window > 0, SOFTCAP=softcap > 0,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    if num_splits > 1 and not fused and not (decode_only and cfg.combine == "none"):
        _combine_splits_kernel[(num_tokens - first_seq, num_heads)](
            out[first_seq:], part_acc[first_seq:], part_ml[first_seq:], num_splits,
            out.stride(0), out.stride(1),
            SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            num_warps=4,
        )  # fmt: skip
    return out
