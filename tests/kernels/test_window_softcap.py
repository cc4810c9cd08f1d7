"""Sliding windows and score soft-capping in the paged-attention kernel, against the PyTorch reference.

Windows shorter and longer than the contexts, with and without a soft-cap, on every path: decode (one
program per sequence, split-KV with the fused and the separate combine, the register-prefetched tiles),
prefill and chunked prefill (unified), and mixed batches. Blocks wholly before every window are poisoned
with NaN: the kernel must not read them (the reference, which gathers the whole context, runs on the clean
cache).
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.attention_config import AttentionConfig
from pagedserve.kernels.triton_attention import paged_attention
from tests.kernels.conftest import PagedBatch, assert_close_per_sequence, gpu, make_paged_batch

# Tiles of one block (16 tokens), so short contexts span several tiles and the window skips some of them.
SMALL_TILES = AttentionConfig(block_m=32, tile_n=16, num_warps=4, num_stages=2)
PREFETCH_TILES = AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1, register_prefetch=True)
SEPARATE_COMBINE = AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=2, combine="separate")

DECODE_SEQ_LENS = [1, 17, 64, 33, 100, 150]
# Full prompt, chunks starting part-way, decodes mixed in (the decodes first, as the scheduler orders them).
MIXED_SEQ_LENS = [40, 77, 5, 120, 61, 90]
MIXED_Q_LENS = [1, 1, 5, 50, 61, 13]


def _reference(batch: PagedBatch, window: int, softcap: float) -> torch.Tensor:
    args = batch.attention_args()
    for name in ("query", "k_cache", "v_cache"):
        args[name] = args[name].to(torch.float64)
    return reference.paged_attention(**args, sliding_window=window, softcap=softcap)


def _poison_unread_blocks(batch: PagedBatch, window: int, tile_n: int) -> PagedBatch:
    """A copy of `batch` whose blocks lying wholly before the first KV tile of every query's window hold
    NaN: a kernel that reads one of them gives NaN."""
    k, v = batch.k_cache.clone(), batch.v_cache.clone()
    block_size = k.shape[1]
    starts = batch.query_start_loc.tolist()
    for b, seq_len in enumerate(batch.seq_lens.tolist()):
        first_q = seq_len - (starts[b + 1] - starts[b])
        first_tile_pos = max(first_q - window + 1, 0) // tile_n * tile_n
        for i in range(first_tile_pos // block_size):
            block = int(batch.block_tables[b, i])
            k[block], v[block] = float("nan"), float("nan")
    return PagedBatch(**{**batch.__dict__, "k_cache": k, "v_cache": v})


def _run_and_check(batch: PagedBatch, window: int, softcap: float, config: AttentionConfig, **kwargs) -> None:
    expected = _reference(batch, window, softcap)  # before poisoning
    if window > 0:
        batch = _poison_unread_blocks(batch, window, config.tile_n)
    out = torch.full_like(batch.query, float("nan"))
    paged_attention(
        **batch.attention_args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
        out=out, config=config, sliding_window=window, softcap=softcap, **kwargs,
    )  # fmt: skip
    assert_close_per_sequence(out, expected, batch.query_start_loc, batch.query.dtype)


def test_reference_window_and_softcap_follow_their_definitions() -> None:
    # One sequence by hand: the reference's window and cap against the plain formula.
    gen = torch.Generator().manual_seed(0)
    seq_len, window, cap, scale = 11, 4, 2.0, 0.5
    q = torch.randn(3, 2, 16, generator=gen, dtype=torch.float64)  # the last 3 positions, 2 heads
    kv = torch.randn(2, 1, seq_len, 1, 16, generator=gen, dtype=torch.float64)  # K, V: 1 block of 11
    table = torch.zeros(1, 1, dtype=torch.int32)
    out = reference.paged_attention(
        q, kv[0], kv[1], table, torch.tensor([seq_len]), torch.tensor([0, 3]), scale,
        sliding_window=window, softcap=cap,
    )  # fmt: skip
    k, v = kv[0, 0, :, 0], kv[1, 0, :, 0]  # [seq_len, 16]
    for t, p in enumerate(range(seq_len - 3, seq_len)):
        keys = torch.arange(p - window + 1, p + 1)
        s = cap * torch.tanh(q[t] @ k[keys].T * scale / cap)  # [2, window]
        torch.testing.assert_close(out[t], torch.softmax(s, -1) @ v[keys])


# Head size 32, and 96 (Phi-3-mini: every layer windowed) and 80, padded in registers.
@pytest.mark.parametrize(
    ("window", "softcap", "head_dim"),
    [(0, 5.0, 32), (20, 0.0, 32), (37, 3.0, 32), (1000, 0.0, 32), (20, 0.0, 96), (37, 3.0, 80)],
)
@pytest.mark.parametrize(
    ("num_splits", "config"), [(1, SMALL_TILES), (3, PREFETCH_TILES), (2, SEPARATE_COMBINE)]
)
def test_decode_window_and_softcap_match_reference(
    device: torch.device, window: int, softcap: float, head_dim: int, num_splits: int, config: AttentionConfig
) -> None:
    batch = make_paged_batch(
        DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), 4, 2, head_dim, 16, device=device, seed=window
    )
    _run_and_check(batch, window, softcap, config, num_splits=num_splits)


def test_decode_split_count_follows_the_window(device: torch.device) -> None:
    # Automatic splits over a long context but a short window: split 0 must still hold tokens.
    batch = make_paged_batch([600, 700], [1, 1], 4, 2, 32, 16, device=device, seed=3)
    _run_and_check(batch, 24, 0.0, PREFETCH_TILES)


@pytest.mark.parametrize(
    ("window", "softcap", "head_dim"),
    [(0, 4.0, 32), (7, 0.0, 32), (33, 2.0, 32), (500, 0.0, 32), (33, 0.0, 96), (7, 2.0, 112)],
)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_and_mixed_window_and_softcap_match_reference(
    device: torch.device, window: int, softcap: float, head_dim: int, block_size: int
) -> None:
    batch = make_paged_batch(
        MIXED_SEQ_LENS, MIXED_Q_LENS, 4, 2, head_dim, block_size, device=device, seed=window + block_size,
    )  # fmt: skip
    _run_and_check(batch, window, softcap, SMALL_TILES, num_decode_seqs=2)
    _run_and_check(batch, window, softcap, SMALL_TILES)  # the decodes in the unified path too


@pytest.mark.parametrize(("window", "head_dim"), [(9, 32), (40, 32), (40, 96)])
def test_prefill_split_kv_window_matches_reference(device: torch.device, window: int, head_dim: int) -> None:
    batch = make_paged_batch([100, 70], [60, 70], 4, 2, head_dim, 16, device=device, seed=window)
    _run_and_check(batch, window, 3.0, SMALL_TILES, num_splits=3)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "window", "softcap"),
    [(16, 8, 256, 4096, 50.0), (32, 32, 96, 2047, 0.0)],
    ids=["gemma-2-9b", "phi-3-mini"],
)
def test_gpu_gemma2_shapes_window_and_softcap(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, window: int, softcap: float
) -> None:
    """Gemma-2-9B's attention (16 query heads over 8 KV heads of 256, window 4096, cap 50) and Phi-3-mini's
    (32 heads of 96, window 2047 on every layer) at full contexts on CUDA: decodes past the window, a long
    prefill chunk and a mixed batch, default tiles."""
    device = torch.device("cuda")
    for seq_lens, q_lens, decodes in (
        ([5000, 4097, 300, 8000], [1, 1, 1, 1], 0),
        ([6000, 4500], [1500, 4500], 0),
        ([5000, 9000, 2000], [1, 1, 700], 2),
    ):
        batch = make_paged_batch(
            seq_lens, q_lens, num_heads, num_kv_heads, head_dim, 16, dtype=dtype, device=device, seed=1
        )
        args = batch.attention_args()
        ref = reference.paged_attention(
            **{**args, **{n: args[n].float() for n in ("query", "k_cache", "v_cache")}},
            sliding_window=window, softcap=softcap,
        )  # fmt: skip
        out = paged_attention(
            **args, max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
            num_decode_seqs=decodes, sliding_window=window, softcap=softcap,
        )  # fmt: skip
        assert_close_per_sequence(out, ref, batch.query_start_loc, dtype)
