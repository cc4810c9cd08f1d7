"""The Triton paged-attention kernel against the PyTorch reference: decode, split-KV, prefill, mixed.

Head sizes: 64 throughout, and the sizes that are not a power of 2 (80, 96 for Phi-3-mini, 112; the kernels
pad them to 128 in registers) and 128 beside it on every path, 8 and 160-256 where cheap."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.kernels import reference, triton_attention
from pagedserve.kernels.attention_config import (
    DECODE_CONFIG,
    DECODE_CONFIG_FP8,
    DECODE_SPLIT_CONFIG,
    DECODE_SPLIT_CONFIG_SMALL_HEADS,
    PREFILL_CONFIG,
    AttentionConfig,
    choose_num_splits,
    decode_config,
    padded_head_dim,
    prefill_config,
)
from pagedserve.kernels.triton_attention import paged_attention
from tests.kernels.conftest import PagedBatch, assert_close_per_sequence, gpu, make_paged_batch

# Tiles smaller than the defaults, so short test contexts span several query blocks and KV tiles.
SMALL_TILES = AttentionConfig(block_m=32, tile_n=16, num_warps=4, num_stages=2)
# The split-KV decode tiles' register prefetch (DECODE_SPLIT_CONFIG), on tiles short enough that each
# program of a short test context reads several.
PREFETCH_TILES = AttentionConfig(block_m=16, tile_n=16, num_warps=4, num_stages=1, register_prefetch=True)


def _reference(batch: PagedBatch) -> torch.Tensor:
    """The PyTorch reference on upcast inputs (float64 on the CPU, float32 on CUDA)."""
    up = torch.float64 if batch.query.device.type == "cpu" else torch.float32
    args = batch.attention_args()
    for name in ("query", "k_cache", "v_cache"):
        args[name] = args[name].to(up)
    return reference.paged_attention(**args)


def _run_and_check(batch: PagedBatch, **kwargs) -> torch.Tensor:
    out = torch.full_like(batch.query, float("nan"))  # poison: every element must be written
    paged_attention(
        **batch.attention_args(),
        max_query_len=batch.max_query_len,
        max_seq_len=batch.max_seq_len,
        out=out,
        **kwargs,
    )
    assert_close_per_sequence(out, _reference(batch), batch.query_start_loc, batch.query.dtype)
    return out


# Decode contexts: 1, lengths off the block size, several blocks, longer than one KV tile.
DECODE_SEQ_LENS = [1, 17, 64, 33, 2, 100, 150]


# Head sizes beside 64: the ones padded in registers (80, 96, 112), and 128 which they are padded to.
BLOCK_AND_HEAD_SIZES = [(16, 64), (32, 64), (16, 80), (32, 96), (16, 112), (32, 128)]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (16, 2)])  # GQA 1, 4, 8
@pytest.mark.parametrize(("block_size", "head_dim"), BLOCK_AND_HEAD_SIZES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(
    device: torch.device, num_heads: int, num_kv_heads: int, block_size: int, head_dim: int, num_splits: int
) -> None:
    batch = make_paged_batch(
        DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), num_heads, num_kv_heads, head_dim, block_size,
        device=device, seed=num_heads + block_size + num_splits + head_dim,
    )  # fmt: skip
    _run_and_check(batch, num_splits=num_splits)


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (16, 2)])  # GQA 1, 4, 8
@pytest.mark.parametrize(("block_size", "head_dim"), [(16, 64), (32, 64), (16, 96), (32, 80)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_register_prefetch_matches_reference(
    device: torch.device, num_heads: int, num_kv_heads: int, block_size: int, head_dim: int, num_splits: int
) -> None:
    # Each program's next tile is loaded before the current one's math, its block-table entries a tile
    # earlier: contexts of 1 to 10 tiles cover a program with no tile, one (only the speculative loads), two
    # and many, and the masked loads past the end.
    batch = make_paged_batch(
        DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), num_heads, num_kv_heads, head_dim, block_size,
        device=device, seed=7 * num_heads + block_size + num_splits + head_dim,
    )  # fmt: skip
    _run_and_check(batch, num_splits=num_splits, config=PREFETCH_TILES)


def test_decode_config_prefetches_in_registers_for_split_kv() -> None:
    assert decode_config(128, fp8=False, split=True) is DECODE_SPLIT_CONFIG
    assert DECODE_SPLIT_CONFIG.register_prefetch and DECODE_SPLIT_CONFIG.num_stages == 1
    # Unsplit batches, and FP8 caches at head size 128, keep the shared-memory pipeline.
    assert decode_config(128, fp8=False, split=False) is DECODE_CONFIG
    assert decode_config(64, fp8=False, split=True) is DECODE_SPLIT_CONFIG_SMALL_HEADS
    assert DECODE_SPLIT_CONFIG_SMALL_HEADS.register_prefetch
    assert decode_config(64, fp8=False, split=False) is DECODE_CONFIG
    assert decode_config(128, fp8=True, split=True) is DECODE_CONFIG_FP8
    assert decode_config(64, fp8=True, split=True) is DECODE_SPLIT_CONFIG_SMALL_HEADS
    assert decode_config(64, fp8=True, split=False) is DECODE_CONFIG


@pytest.mark.parametrize("head_dim", [80, 96, 112])
def test_head_sizes_between_powers_of_2_take_the_tuned_tiles_of_the_padded_size(head_dim: int) -> None:
    # The tiles are those of 128 (what the registers hold), tuned in docs/kernels.md; the cache is not padded.
    assert padded_head_dim(head_dim) == 128
    assert decode_config(padded_head_dim(head_dim), fp8=False, split=True) is DECODE_SPLIT_CONFIG
    assert prefill_config(padded_head_dim(head_dim)) is PREFILL_CONFIG
    assert [padded_head_dim(d) for d in (8, 16, 24, 40, 64, 72, 160, 192, 256)] == [
        16, 16, 32, 64, 64, 128, 256, 256, 256,
    ]  # fmt: skip


@pytest.mark.parametrize("head_dim", [0, 4, 12, 100, 264, 512])
def test_head_sizes_the_kernels_do_not_take_are_refused_by_name(device: torch.device, head_dim: int) -> None:
    with pytest.raises(ValueError, match=f"head size {head_dim} is not supported.*multiple of 8 up to 256"):
        padded_head_dim(head_dim)
    query = torch.zeros(1, 2, head_dim, device=device)
    cache = torch.zeros(1, 16, 2, head_dim, device=device)
    one = torch.ones(1, dtype=torch.int32, device=device)
    with pytest.raises(ValueError, match="multiple of 8"):
        paged_attention(
            query, cache, cache, torch.zeros(1, 1, dtype=torch.int32, device=device), one,
            torch.tensor([0, 1], dtype=torch.int32, device=device), 1.0, 1, 1,
        )  # fmt: skip


def test_padded_head_writes_exactly_head_dim_columns(device: torch.device) -> None:
    # The output rows are head_dim wide: a write of the pad columns would land in the next head's values
    # (here an output whose rows lie in a wider buffer, a sentinel after each head's 96 values).
    for seq_lens, q_lens, splits in (([1, 70, 150], [1, 1, 1], 3), ([37, 50], [37, 5], 2)):
        batch = make_paged_batch(seq_lens, q_lens, 8, 2, 96, 16, device=device, seed=len(seq_lens))
        wide = torch.full((*batch.query.shape[:2], 128), 7.0, device=device)
        out = wide[..., :96]
        paged_attention(
            **batch.attention_args(), max_query_len=batch.max_query_len, max_seq_len=batch.max_seq_len,
            out=out, num_splits=splits,
        )  # fmt: skip
        assert (wide[..., 96:] == 7.0).all()
        assert_close_per_sequence(out, _reference(batch), batch.query_start_loc, batch.query.dtype)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_token_major_blocks_match_reference(device: torch.device, num_splits: int) -> None:
    # The worker keeps blocks head-major (the batches above); a contiguous token-major pool reads the same.
    decode = make_paged_batch(
        DECODE_SEQ_LENS, [1] * len(DECODE_SEQ_LENS), 8, 2, 64, 16, device=device, seed=9, layout="token"
    )
    assert decode.k_cache.is_contiguous()
    _run_and_check(decode, num_splits=num_splits)
    seq_lens, q_lens = _mixed_lens(16)
    mixed = make_paged_batch(seq_lens, q_lens, 8, 2, 64, 16, device=device, seed=10, layout="token")
    _run_and_check(mixed, num_splits=num_splits, config=SMALL_TILES)


@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_decode_half_precision_and_automatic_split(device: torch.device, head_dim: int) -> None:
    # One long context among short ones: the automatic choice splits it, short ones get empty splits.
    seq_lens = [700, 3, 40]
    batch = make_paged_batch(seq_lens, [1, 1, 1], 8, 2, head_dim, 16, torch.float16, device, seed=head_dim)
    assert choose_num_splits(device, 3, 2, 700, head_dim) > 1
    _run_and_check(batch)


@pytest.mark.parametrize("num_splits", [2, 8])
def test_decode_fused_combine_twice_with_the_same_buffers(device: torch.device, num_splits: int) -> None:
    # The last split of each (sequence, KV head) combines, found through a counter that it resets: a second
    # call on the same buffers (as a CUDA-graph replay makes) must count from zero again.
    batch = make_paged_batch([150, 1, 70], [1, 1, 1], 8, 2, 64, 16, device=device, seed=num_splits)
    first = _run_and_check(batch, num_splits=num_splits)
    counters = triton_attention._counters[batch.query.device]
    assert (counters == 0).all(), "the last split must reset its counter"
    out = torch.full_like(batch.query, float("nan"))
    for _ in range(2):
        paged_attention(
            **batch.attention_args(), max_query_len=1, max_seq_len=batch.max_seq_len, out=out,
            num_splits=num_splits,
        )  # fmt: skip
        assert torch.equal(out, first)
    assert (counters == 0).all()


@pytest.mark.parametrize("config", [SMALL_TILES, PREFETCH_TILES], ids=["small-tiles", "register-prefetch"])
@pytest.mark.parametrize("head_dim", [64, 112])
def test_decode_fused_combine_with_empty_splits(
    device: torch.device, config: AttentionConfig, head_dim: int
) -> None:
    # 16 splits of 16-token tiles over contexts of 1-40 tokens: most splits of every sequence hold no tile
    # (m = -inf, weight 0), including the last split, which combines.
    batch = make_paged_batch([1, 40, 17, 3], [1, 1, 1, 1], 8, 2, head_dim, 16, device=device, seed=11)
    _run_and_check(batch, num_splits=16, config=config)


@pytest.mark.parametrize(
    ("num_splits", "config"),
    [(1, None), (3, None), (8, SMALL_TILES), (1, PREFETCH_TILES), (3, PREFETCH_TILES)],
)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_decode_ignores_what_lies_outside_the_contexts(
    device: torch.device, num_splits: int, config: AttentionConfig | None, head_dim: int
) -> None:
    # Each decode program loads its first tile (with the register prefetch, also its second tile's block-table
    # entries) before it knows the sequence length: block-table entries past a sequence's blocks (here -1
    # and far out of range) and every cache slot outside the contexts (here NaN, as never-written memory
    # may hold) are read but must not reach the output.
    clean = make_paged_batch([1, 40, 17, 130], [1, 1, 1, 1], 8, 2, head_dim, 16, device=device, seed=5)
    block_size = clean.k_cache.shape[1]
    outside = torch.ones(clean.k_cache.shape[:2], dtype=torch.bool, device=device)  # [num_blocks, block_size]
    tables = clean.block_tables.clone()
    for b, n in enumerate(clean.seq_lens.tolist()):
        used = -(-n // block_size)
        pos = torch.arange(n, device=device)
        outside[tables[b, pos // block_size].long(), pos % block_size] = False
        tables[b, used:] = torch.tensor([-1, 10**6], dtype=torch.int32).repeat(tables.shape[1])[
            : tables.shape[1] - used
        ]
    poisoned = PagedBatch(**{**vars(clean), "block_tables": tables})
    poisoned.k_cache = clean.k_cache.masked_fill(outside[:, :, None, None], float("nan"))
    poisoned.v_cache = clean.v_cache.masked_fill(outside[:, :, None, None], float("nan"))
    assert outside.any()
    out = torch.full_like(clean.query, float("nan"))
    paged_attention(
        **poisoned.attention_args(), max_query_len=1, max_seq_len=clean.max_seq_len, out=out,
        num_splits=num_splits, config=config,
    )  # fmt: skip
    assert_close_per_sequence(out, _reference(clean), clean.query_start_loc, clean.query.dtype)


@pytest.mark.parametrize("combine", ["fused", "separate"])
@pytest.mark.parametrize("head_dim", [64, 80])
def test_decode_split_combine_is_a_config_choice(device: torch.device, combine: str, head_dim: int) -> None:
    # The combine kernel is chosen through the config (the benchmark compares the two), never a global.
    batch = make_paged_batch([150, 1, 70], [1, 1, 1], 8, 2, head_dim, 16, device=device, seed=3)
    config = replace(decode_config(64, fp8=False, split=True), combine=combine)
    _run_and_check(batch, num_splits=4, config=config)


def test_choose_num_splits_only_when_the_batch_leaves_the_gpu_idle() -> None:
    cuda_like = torch.device("cpu")  # 4 "multiprocessors": a target of 16 programs
    for head_dim in (64, 128):
        assert choose_num_splits(cuda_like, 1, 8, 8192, head_dim) > 1
        assert choose_num_splits(cuda_like, 1, 8, 100, head_dim) == 1  # short context: no split
        assert choose_num_splits(cuda_like, 4096, 8, 8192, head_dim) == 1  # the batch fills the GPU
    # 24 programs, more than the GPU runs at once at head size 128: two splits shorten the last wave; at
    # head size 64 they all run at once.
    assert choose_num_splits(cuda_like, 3, 8, 8192, 128) == 2
    assert choose_num_splits(cuda_like, 3, 8, 8192, 64) == 1


# Full prefill, chunks starting part-way (prefix hit, later chunk of a chunked prefill), decodes mixed in.
def _mixed_lens(block_size: int) -> tuple[list[int], list[int]]:
    seq_lens = [1, 37, 2 * block_size, 50, 9, block_size + 1, 3, 70]
    q_lens = [1, 37, 5, 1, 9, block_size, 1, 33]
    return seq_lens, q_lens


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (8, 2), (8, 1)])  # GQA 1, 4, 8
# (128 on this path: test_prefill_half_precision_with_split_kv.)
@pytest.mark.parametrize(("block_size", "head_dim"), BLOCK_AND_HEAD_SIZES[:-1])
@pytest.mark.parametrize("config", [None, SMALL_TILES], ids=["default-tiles", "small-tiles"])
def test_prefill_and_mixed_batch_match_reference(
    device: torch.device, num_heads: int, num_kv_heads: int, block_size: int, head_dim: int,
    config: AttentionConfig | None,
) -> None:  # fmt: skip
    seq_lens, q_lens = _mixed_lens(block_size)
    batch = make_paged_batch(
        seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, device=device, seed=3 + head_dim
    )
    _run_and_check(batch, config=config)


@pytest.mark.parametrize("head_dim", [96, 128])
def test_prefill_half_precision_with_split_kv(device: torch.device, head_dim: int) -> None:
    seq_lens, q_lens = _mixed_lens(16)
    batch = make_paged_batch(seq_lens, q_lens, 8, 2, head_dim, 16, torch.float16, device, seed=5)
    _run_and_check(batch, num_splits=2, config=SMALL_TILES)


@pytest.mark.parametrize(
    ("num_heads", "config", "num_splits"),
    [(8, None, None), (16, None, 2), (8, SMALL_TILES, None), (4, SMALL_TILES, 3)],
)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_mixed_batch_sends_its_leading_decodes_down_the_decode_path(
    device: torch.device,
    num_heads: int,
    config: AttentionConfig | None,
    num_splits: int | None,
    head_dim: int,
) -> None:
    # 11 decodes first (as plans order them), then chunks of 1-3 tokens (so the unified path's query
    # blocks are small and its programs start past the decodes: first_program > 0), a 1-token chunk among
    # them that stays on the unified path, and a longer prompt.
    seq_lens = [40, 1, 17, 90, 33, 2, 64, 16, 70, 5, 120] + [3, 50, 1, 37, 24]
    q_lens = [1] * 11 + [3, 2, 1, 2, 24]
    batch = make_paged_batch(seq_lens, q_lens, num_heads, 2, head_dim, 16, device=device, seed=num_heads)
    _run_and_check(batch, config=config, num_splits=num_splits, num_decode_seqs=11)
    short = make_paged_batch(seq_lens[:14], q_lens[:14], num_heads, 2, head_dim, 16, device=device, seed=1)
    _run_and_check(short, config=config, num_splits=num_splits, num_decode_seqs=11)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], list[int], int, int, int, int]:
    num_decodes = draw(st.integers(0, 4))
    num_seqs = draw(st.integers(1, 5))
    seq_lens = draw(
        st.lists(st.integers(1, 90), min_size=num_decodes + num_seqs, max_size=num_decodes + num_seqs)
    )
    q_lens = [1] * num_decodes + [draw(st.integers(1, n)) for n in seq_lens[num_decodes:]]
    group = draw(st.sampled_from([1, 2, 4, 8]))
    block_size = draw(st.sampled_from([16, 32]))
    head_dim = draw(st.sampled_from([64, 80, 96, 112, 128]))
    return seq_lens, q_lens, group, block_size, num_decodes, head_dim


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_batches(), seed=st.integers(0, 2**31 - 1))
def test_random_batches_match_reference(device: torch.device, case: tuple, seed: int) -> None:
    seq_lens, q_lens, group, block_size, num_decodes, head_dim = case
    batch = make_paged_batch(seq_lens, q_lens, 2 * group, 2, head_dim, block_size, device=device, seed=seed)
    _run_and_check(batch, config=SMALL_TILES, num_decode_seqs=num_decodes)


@pytest.mark.parametrize("head_dim", [8, 160, 192, 256])
def test_small_and_large_head_sizes_on_every_path(device: torch.device, head_dim: int) -> None:
    # 8 pads to 16 (tl.dot's least), 160 and 192 to 256; 256 itself (Gemma 2/3) unpadded. Decode (split,
    # fused combine), prefill with split KV (separate combine), a mixed batch.
    decode = make_paged_batch([1, 70, 33], [1, 1, 1], 4, 2, head_dim, 16, device=device, seed=head_dim)
    _run_and_check(decode, num_splits=3, config=SMALL_TILES)
    seq_lens, q_lens = [40, 20, 37, 50], [1, 1, 37, 5]
    mixed = make_paged_batch(seq_lens, q_lens, 4, 2, head_dim, 16, device=device, seed=head_dim + 1)
    _run_and_check(mixed, num_splits=2, config=SMALL_TILES, num_decode_seqs=2)


# ---------------------------------------------------------------------------------------------------------
# Full shapes on the GPU (Llama-like: 32 query heads, 8 KV heads, head size 128).


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [
        (32, 8, 128, 16),
        (32, 32, 128, 16),
        (32, 4, 128, 32),
        (32, 8, 64, 32),
        (32, 32, 96, 16),
        (32, 8, 80, 16),
    ],
)
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
@pytest.mark.parametrize("num_splits", [None, 1])
@gpu
def test_gpu_decode_full_shapes(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, num_seqs: int,
    num_splits: int | None,
) -> None:  # fmt: skip
    gen = torch.Generator().manual_seed(num_seqs)
    seq_lens = torch.randint(1, 4097, (num_seqs,), generator=gen).tolist()
    seq_lens[0] = 4096 + 7 if num_seqs == 1 else 1
    batch = make_paged_batch(
        seq_lens, [1] * num_seqs, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", seed=num_seqs
    )
    _run_and_check(batch, num_splits=num_splits)


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "dtype"),
    [(32, 8, torch.bfloat16), (32, 32, torch.bfloat16), (32, 4, torch.bfloat16), (32, 8, torch.float16)],
)
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("mix", ["prefill-only", "mixed"])
@pytest.mark.parametrize("head_dim", [128, 96])  # 96: Phi-3-mini's heads
@gpu
def test_gpu_prefill_and_mixed_full_shapes(
    num_heads: int, num_kv_heads: int, dtype: torch.dtype, block_size: int, mix: str, head_dim: int
) -> None:
    # A full 2k prompt, a 1000-token chunk 1500 tokens into its sequence, a 333-token prompt; "mixed" adds
    # 150 decodes of uneven contexts.
    seq_lens, q_lens = [2048, 2500, 333], [2048, 1000, 333]
    if mix == "mixed":
        gen = torch.Generator().manual_seed(1)
        decodes = torch.randint(1, 3000, (150,), generator=gen).tolist()
        seq_lens, q_lens = decodes[:70] + seq_lens + decodes[70:], [1] * 70 + q_lens + [1] * 80
    batch = make_paged_batch(seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda")
    _run_and_check(batch)


@gpu
def test_gpu_decode_fused_combine_in_cuda_graph() -> None:
    # Batch 1 x 8k with the automatic splits, captured once and replayed with new queries: the split counters
    # must be back at zero after every replay.
    batch = make_paged_batch([8192 + 5], [1], 32, 8, 128, 16, torch.bfloat16, "cuda", seed=2)
    out = torch.empty_like(batch.query)
    max_seq_len = batch.max_seq_len  # host-side, read before the capture

    def call() -> None:
        paged_attention(**batch.attention_args(), max_query_len=1, max_seq_len=max_seq_len, out=out)

    call()  # compile, allocate the counters outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(3):
        batch.query.copy_(torch.randn(batch.query.shape, generator=gen, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        assert_close_per_sequence(out, _reference(batch), batch.query_start_loc, batch.query.dtype)
