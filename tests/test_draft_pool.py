"""The draft model's block allocator (worker/spec/draft_pool.py) under random grows, truncations and frees."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.worker.spec.draft_pool import DraftBlockPool

NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS = 12, 4, 5

ops = st.lists(
    st.tuples(st.sampled_from(["grow", "truncate", "free"]), st.integers(0, 3), st.integers(0, 24)),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_every_block_is_free_or_held_once_after_every_operation(operations) -> None:
    pool = DraftBlockPool(NUM_BLOCKS, BLOCK_SIZE, MAX_BLOCKS)
    for op, seq_id, num_tokens in operations:
        if op == "free":
            pool.free(seq_id)
        else:
            seq = pool.get(seq_id)
            if op == "grow":
                had, free = len(seq.block_ids), pool.num_free_blocks
                need = -(-num_tokens // BLOCK_SIZE) - had
                fits = max(0, need) <= free and had + max(0, need) <= MAX_BLOCKS
                assert pool.grow(seq, num_tokens) == fits
                if fits:
                    assert len(seq.block_ids) == max(had, -(-num_tokens // BLOCK_SIZE))
                    seq.computed = list(range(max(len(seq.computed), num_tokens)))
                else:
                    assert len(seq.block_ids) == had and pool.num_free_blocks == free
            else:
                keep = min(num_tokens, len(seq.computed))
                pool.truncate(seq, keep)
                assert len(seq.computed) == keep and len(seq.block_ids) == -(-keep // BLOCK_SIZE)
        pool.check_invariants()
    for seq_id in range(4):
        pool.free(seq_id)
    pool.check_invariants()
    assert pool.num_free_blocks == NUM_BLOCKS
