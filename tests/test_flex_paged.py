"""scripts/flex_paged.py: flex_attention decode over the paged KV cache, against the PyTorch reference."""

from __future__ import annotations

import torch

from pagedserve.kernels.reference import kv_pool, paged_attention
from scripts.flex_paged import flex_paged_decode, paged_block_mask, to_flex_pool

PAGE = 16
SEQ_LENS = [1, 17, 40, 64]  # a lone token, one past a page, mid-page, exactly whole pages
NUM_PAGES = 16  # more than the 10 the sequences use: spare pages hold random data that must not leak in
MAX_PAGES = 6  # table columns, wider than the longest sequence's 4 pages


def _block_tables(gen: torch.Generator) -> torch.Tensor:  # [B, MAX_PAGES] int32
    """Each sequence's pages taken in order from a random permutation of the pool; padding entries point at
    pages of other sequences."""
    perm = torch.randperm(NUM_PAGES, generator=gen)
    tables = torch.empty(len(SEQ_LENS), MAX_PAGES, dtype=torch.int32)
    start = 0
    for b, n in enumerate(-(-s // PAGE) for s in SEQ_LENS):
        others = torch.cat([perm[:start], perm[start + n :]])
        tables[b] = torch.cat([perm[start : start + n], others[: MAX_PAGES - n]])
        start += n
    return tables


def test_block_mask_visits_exactly_each_sequences_pages() -> None:
    gen = torch.Generator().manual_seed(0)
    tables = _block_tables(gen)
    mask = paged_block_mask(tables, torch.tensor(SEQ_LENS, dtype=torch.int32), NUM_PAGES, PAGE)

    full_num = mask.full_kv_num_blocks[:, 0, 0]  # [B]
    partial_num = mask.kv_num_blocks[:, 0, 0]
    assert full_num.tolist() == [s // PAGE for s in SEQ_LENS]
    assert partial_num.tolist() == [int(s % PAGE > 0) for s in SEQ_LENS]
    assert (full_num + partial_num).tolist() == [-(-s // PAGE) for s in SEQ_LENS]
    assert mask.full_kv_indices.shape[-1] == mask.kv_indices.shape[-1] == NUM_PAGES
    for b, s in enumerate(SEQ_LENS):
        full, partial = s // PAGE, int(s % PAGE > 0)
        assert mask.full_kv_indices[b, 0, 0, :full].tolist() == tables[b, :full].tolist()
        assert mask.kv_indices[b, 0, 0, :partial].tolist() == tables[b, full : full + partial].tolist()
        if partial:  # the mask_mod keeps the first s % PAGE tokens of the partial page, wherever it lies
            page = int(tables[b, full])
            kv = torch.arange(page * PAGE, (page + 1) * PAGE)
            kept = mask.mask_mod(torch.tensor(b), torch.tensor(0), torch.tensor(0), kv)
            assert kept.tolist() == [i < s % PAGE for i in range(PAGE)]


def test_to_flex_pool_puts_page_p_token_i_at_position_p_times_page_plus_i() -> None:
    cache = kv_pool(lambda shape: torch.randn(shape), 5, PAGE, 2, 8, layout="head")
    pool = to_flex_pool(cache)
    assert pool.shape == (1, 2, 5 * PAGE, 8) and pool.is_contiguous()
    assert torch.equal(pool[0, 1, 3 * PAGE + 7], cache[3, 7, 1])


def test_flex_paged_decode_matches_reference() -> None:
    gen = torch.Generator().manual_seed(1)
    num_heads, num_kv_heads, head_dim = 8, 2, 32  # GQA: 4 query heads per KV head
    tables = _block_tables(gen)
    seq_lens = torch.tensor(SEQ_LENS, dtype=torch.int32)

    def make(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=gen)

    # The worker's head-major layout: to_flex_pool must read it through its strides.
    k_cache = kv_pool(make, NUM_PAGES, PAGE, num_kv_heads, head_dim, layout="head")
    v_cache = kv_pool(make, NUM_PAGES, PAGE, num_kv_heads, head_dim, layout="head")
    query = torch.randn(len(SEQ_LENS), num_heads, head_dim, generator=gen)
    scale = head_dim**-0.5

    mask = paged_block_mask(tables, seq_lens, NUM_PAGES, PAGE)
    out = flex_paged_decode(query, to_flex_pool(k_cache), to_flex_pool(v_cache), mask, scale)

    query_start_loc = torch.arange(len(SEQ_LENS) + 1, dtype=torch.int32)  # one decode token each
    ref = paged_attention(query, k_cache, v_cache, tables, seq_lens, query_start_loc, scale)
    assert out.shape == ref.shape == (len(SEQ_LENS), num_heads, head_dim)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    # A lone token's context is itself: its output is its own value row, per KV head.
    own_value = v_cache[tables[0, 0], 0].repeat_interleave(num_heads // num_kv_heads, dim=0)  # [Hq, D]
    torch.testing.assert_close(out[0], own_value, rtol=1e-5, atol=1e-5)
