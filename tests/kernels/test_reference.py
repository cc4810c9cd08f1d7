"""The PyTorch paged-attention reference against dense attention computed independently, per sequence."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import reference
from pagedserve.kernels.reference import kv_pool, paged_attention, write_kv


def _dense_causal_attention(
    q: torch.Tensor,  # [q_len, Hq, D], the last q_len positions of the context
    k: torch.Tensor,  # [seq_len, Hkv, D]
    v: torch.Tensor,  # [seq_len, Hkv, D]
    scale: float,
) -> torch.Tensor:  # [q_len, Hq, D]
    """Plain matmul-softmax attention in float64, each query head mapped to its KV head by hand."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.empty(q_len, num_heads, q.shape[-1], dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()  # [seq_len, D]
        scores = (q[:, h].double() @ kh.T) * scale  # [q_len, seq_len]
        for i in range(q_len):
            visible = seq_len - q_len + i + 1
            scores[i, visible:] = float("-inf")
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def _make_batch(
    gen: torch.Generator,
    seq_lens: list[int],
    q_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
) -> dict:
    """Random contexts written into a cache through shuffled block tables, plus random query chunks."""
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5  # spare blocks that no sequence owns
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, i = [], 0
    for n in blocks_per_seq:
        tables.append(perm[i : i + n])
        i += n
    max_blocks = max(blocks_per_seq) + 2  # wider than needed: padding must be ignored
    block_tables = torch.full((len(seq_lens), max_blocks), 0, dtype=torch.int32)
    for b, t in enumerate(tables):
        block_tables[b, : len(t)] = torch.tensor(t, dtype=torch.int32)
        # Padding entries point at real blocks of other sequences, which must not leak in.
        block_tables[b, len(t) :] = perm[0]

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen)
    v_cache = torch.randn(shape, generator=gen)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seq_lens]
    for b, n in enumerate(seq_lens):
        pos = torch.arange(n)
        slots = torch.tensor(tables[b])[pos // block_size] * block_size + pos % block_size
        k_cache.view(-1, num_kv_heads, head_dim)[slots] = keys[b]
        v_cache.view(-1, num_kv_heads, head_dim)[slots] = values[b]
    queries = [torch.randn(q, num_heads, head_dim, generator=gen) for q in q_lens]
    query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
    return {
        "keys": keys,
        "values": values,
        "queries": queries,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "block_tables": block_tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": query_start_loc,
    }


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(4, 4, 64, 16), (8, 2, 128, 32), (16, 2, 64, 32), (8, 1, 128, 16)],
)
def test_paged_attention_matches_dense_causal_attention(
    num_heads: int, num_kv_heads: int, head_dim: int, block_size: int
) -> None:
    gen = torch.Generator().manual_seed(num_heads * 1000 + head_dim + block_size)
    # Full prefills, chunks starting part-way, decodes (q_len 1, context 1 included), lengths off the block.
    seq_lens = [1, 37, 2 * block_size, 50, 9, block_size + 1, 3]
    q_lens = [1, 37, 5, 1, 9, block_size, 1]
    batch = _make_batch(gen, seq_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size)
    scale = head_dim**-0.5

    out = paged_attention(
        torch.cat(batch["queries"]),
        batch["k_cache"],
        batch["v_cache"],
        batch["block_tables"],
        batch["seq_lens"],
        batch["query_start_loc"],
        scale,
    )

    assert out.shape == (sum(q_lens), num_heads, head_dim)
    starts = batch["query_start_loc"].tolist()
    for b in range(len(seq_lens)):
        expected = _dense_causal_attention(batch["queries"][b], batch["keys"][b], batch["values"][b], scale)
        torch.testing.assert_close(out[starts[b] : starts[b + 1]].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group_tokens", [1 << 16, 128])
def test_paged_attention_decode_only_batch_of_uneven_lengths(
    group_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A small group budget splits the decodes into several groups, as a large batch would.
    monkeypatch.setattr(reference, "_DECODE_GROUP_TOKENS", group_tokens)
    gen = torch.Generator().manual_seed(7)
    seq_lens = [1, 17, 64, 33, 2, 100]
    q_lens = [1] * len(seq_lens)
    batch = _make_batch(gen, seq_lens, q_lens, 8, 2, 64, 16)
    out = paged_attention(
        torch.cat(batch["queries"]),
        batch["k_cache"],
        batch["v_cache"],
        batch["block_tables"],
        batch["seq_lens"],
        batch["query_start_loc"],
        0.125,
    )
    for b in range(len(seq_lens)):
        expected = _dense_causal_attention(batch["queries"][b], batch["keys"][b], batch["values"][b], 0.125)
        torch.testing.assert_close(out[b : b + 1].double(), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("layout", ["head", "token"])
def test_write_kv_fills_exactly_the_mapped_slots(block_size: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(block_size)
    num_blocks, num_kv_heads, head_dim = 12, 2, 64
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache, v_cache = (kv_pool(lambda m: torch.randn(m, generator=gen), *shape, layout) for _ in "kv")
    k_before, v_before = k_cache.clone(), v_cache.clone()
    num_tokens = 3 * block_size + 5
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)

    write_kv(key, value, k_cache, v_cache, slots)

    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, offset], key[t])
        assert torch.equal(v_cache[block, offset], value[t])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    flat = (-1, num_kv_heads, head_dim)
    assert torch.equal(k_cache.reshape(flat)[untouched], k_before.reshape(flat)[untouched])
    assert torch.equal(v_cache.reshape(flat)[untouched], v_before.reshape(flat)[untouched])
