"""The block manager: on-demand allocation, sharing with copy-on-write, the prefix cache and its eviction
order, swapping, and all-or-nothing allocation; invariants after every operation."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.scheduler.block_manager import BlockManager


def _grow(bm: BlockManager, seq_id: int, num_computed: int, num_tokens: int):
    result = bm.allocate_slots(seq_id, num_computed, num_tokens)
    bm.check_invariants()
    return result


def test_allocates_blocks_on_demand_as_the_sequence_grows():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert len(_grow(bm, 0, 0, 1).new_blocks) == 1
    assert _grow(bm, 0, 1, 3).new_blocks == []  # the first block still has room
    assert len(_grow(bm, 0, 4, 1).new_blocks) == 1
    assert len(_grow(bm, 0, 5, 8).new_blocks) == 2
    assert len(bm.block_table(0)) == 4 and bm.num_free_blocks == 4


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    _grow(bm, 0, 0, 8)
    bm.fork(0, 1)  # the last block is shared, so a write would need a copy too
    before = (list(bm.block_table(0)), list(bm.block_table(1)), bm.num_free_blocks)
    assert bm.allocate_slots(2, 0, 12) is None
    assert bm.allocate_slots(0, 8, 12) is None  # needs 3 blocks, 2 free
    refs = [bm.ref_count(b) for b in range(4)]
    assert (list(bm.block_table(0)), list(bm.block_table(1)), bm.num_free_blocks) == before
    assert refs == [bm.ref_count(b) for b in range(4)]
    bm.check_invariants()


def test_free_returns_every_block_and_private_blocks_are_never_shared():
    bm = BlockManager(num_blocks=10, block_size=2, enable_prefix_caching=False)
    for seq_id, n in enumerate([3, 5, 1, 7]):
        _grow(bm, seq_id, 0, n)
    flat = [b for s in range(4) for b in bm.block_table(s)]
    assert len(flat) == len(set(flat)) == 2 + 3 + 1 + 4
    for seq_id in range(4):
        bm.free(seq_id)
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_fork_then_write_into_a_shared_partial_last_block_copies_it_once():
    bm = BlockManager(num_blocks=8, block_size=4)
    _grow(bm, 0, 0, 6)  # blocks [a, b]; b holds 2 tokens
    a, b = bm.block_table(0)
    bm.fork(0, 1)
    bm.fork(0, 2)
    assert bm.ref_count(a) == bm.ref_count(b) == 3
    first = _grow(bm, 1, 6, 1)  # child 1 writes position 6, in the shared block b
    assert len(first.copies) == 1 and first.copies[0][0] == b and first.replaced
    assert bm.block_table(1) == [a, first.copies[0][1]] and bm.ref_count(b) == 2
    second = _grow(bm, 2, 6, 1)
    assert second.copies and second.copies[0][0] == b
    last = _grow(bm, 0, 6, 1)  # the parent is the last holder of b: it writes in place
    assert last.copies == [] and bm.block_table(0) == [a, b] and bm.ref_count(b) == 1
    assert bm.ref_count(a) == 3  # full shared blocks are never copied


def test_full_shared_blocks_are_not_copied_when_growing_past_them():
    bm = BlockManager(num_blocks=8, block_size=4)
    _grow(bm, 0, 0, 8)
    bm.fork(0, 1)
    result = _grow(bm, 1, 8, 1)
    assert result.copies == [] and len(result.new_blocks) == 1


def _computed(bm: BlockManager, seq_id: int, tokens: list[int], salt: str = "") -> None:
    """Allocates and registers a sequence's whole token list as computed."""
    hits = bm.find_cached_prefix(seq_id, tokens, salt)
    bm.allocate_prefix(seq_id, hits)
    computed = len(hits) * bm.block_size
    assert bm.allocate_slots(seq_id, computed, len(tokens) - computed) is not None
    bm.register_computed(seq_id, tokens, len(tokens), salt)
    bm.check_invariants()


def test_prefix_hit_after_the_original_sequence_finished():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(100, 114))  # 3 full blocks + 2 tokens
    _computed(bm, 0, prompt)
    first_blocks = list(bm.block_table(0))
    bm.free(0)
    hits = bm.find_cached_prefix(1, prompt + [7, 8])
    assert hits == first_blocks[:3]
    assert bm.usage({}).blocks_cached == 3


def test_a_fully_cached_prompt_still_computes_its_last_token():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(8))  # exactly 2 full blocks
    _computed(bm, 0, prompt)
    hits = bm.find_cached_prefix(1, prompt)
    assert len(hits) == 1  # the last block is recomputed, so its last token yields logits


def test_cache_salt_separates_tenants():
    bm = BlockManager(num_blocks=16, block_size=4)
    prompt = list(range(12))
    _computed(bm, 0, prompt, salt="tenant-a")
    assert bm.find_cached_prefix(1, prompt + [1], salt="tenant-b") == []
    assert bm.find_cached_prefix(2, prompt + [1]) == []
    assert len(bm.find_cached_prefix(3, prompt + [1], salt="tenant-a")) == 3


def test_eviction_takes_least_recently_used_first_and_a_tail_before_its_prefix():
    bm = BlockManager(num_blocks=6, block_size=2)
    old, new = [1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]
    _computed(bm, 0, old)
    _computed(bm, 1, new)
    old_blocks, new_blocks = list(bm.block_table(0)), list(bm.block_table(1))
    bm.free(0)
    bm.free(1)
    taken = [_grow(bm, 10 + i, 0, 1).new_blocks[0] for i in range(6)]
    assert taken == old_blocks[::-1] + new_blocks[::-1]


def test_uncached_blocks_are_reused_before_cached_ones():
    bm = BlockManager(num_blocks=4, block_size=2)
    _computed(bm, 0, [1, 2, 3, 4])  # two full, registered blocks
    _grow(bm, 1, 0, 1)  # a partial block: nothing to cache
    partial = bm.block_table(1)[0]
    bm.free(0)
    bm.free(1)
    assert _grow(bm, 2, 0, 1).new_blocks == [partial]


def test_a_hit_on_a_free_cached_block_is_not_evicted_for_the_same_sequence():
    bm = BlockManager(num_blocks=3, block_size=2)
    prompt = [1, 2, 3, 4]
    _computed(bm, 0, prompt)
    bm.free(0)  # both blocks free and cached; one more free block
    hits = bm.find_cached_prefix(1, prompt + [5])
    assert len(hits) == 2
    assert bm.num_blocks_to_admit(hits, 5) == 3  # the two free hits plus one new block
    bm.allocate_prefix(1, hits)
    result = bm.allocate_slots(1, 4, 1)
    assert result is not None and result.new_blocks[0] not in hits
    assert bm.block_table(1)[:2] == hits
    bm.check_invariants()


def test_swap_out_and_in_moves_the_table_and_refuses_when_gpu_is_short():
    bm = BlockManager(num_blocks=4, block_size=4, num_cpu_blocks=4)
    _grow(bm, 0, 0, 12)
    gpu = list(bm.block_table(0))
    pairs = bm.swap_out(0)
    assert [g for g, _ in pairs] == gpu and bm.num_free_blocks == 4 and bm.num_free_cpu_blocks == 1
    bm.check_invariants()
    _grow(bm, 1, 0, 8)  # now only 2 GPU blocks are free
    assert bm.swap_in(0) is None and bm.cpu_block_table(0)
    bm.check_invariants()
    bm.free(1)
    back = bm.swap_in(0)
    assert [c for c, _ in back] == [c for _, c in pairs] and bm.block_table(0) == [g for _, g in back]
    assert bm.num_free_cpu_blocks == 4
    bm.check_invariants()


def test_invariant_check_catches_a_corrupted_free_queue():
    bm = BlockManager(num_blocks=4, block_size=4)
    _grow(bm, 0, 0, 4)
    bm._free[bm.block_table(0)[0]] = None  # the block is now both used and free
    with pytest.raises(AssertionError):
        bm.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admit / grow / fork / swap / free operations against a model of what each table must cover.
    Tokens are drawn from a tiny alphabet so prompts share prefixes and the cache gets hits."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=12, block_size=2, num_cpu_blocks=6)
        self.tokens: dict[int, list[int]] = {}  # live on the GPU: token ids, all computed
        self.swapped: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=9))
    def admit(self, prompt: list[int]) -> None:
        seq_id = self.next_id
        self.next_id += 1
        hits = self.bm.find_cached_prefix(seq_id, prompt)
        needed = self.bm.num_blocks_to_admit(hits, len(prompt))
        refs = [self.bm.ref_count(b) for b in range(12)]
        if needed > self.bm.num_free_blocks:
            assert refs == [self.bm.ref_count(b) for b in range(12)]
            self.bm.free(seq_id)  # drops the hashes it computed
            return
        self.bm.allocate_prefix(seq_id, hits)
        computed = len(hits) * 2
        assert self.bm.allocate_slots(seq_id, computed, len(prompt) - computed) is not None
        self.bm.register_computed(seq_id, prompt, len(prompt))
        self.tokens[seq_id] = list(prompt)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), grow=st.integers(1, 5))
    def grow(self, data: st.DataObject, grow: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        n = len(self.tokens[seq_id])
        table_before = list(self.bm.block_table(seq_id))
        free_before = self.bm.num_free_blocks
        result = self.bm.allocate_slots(seq_id, n, grow)
        if result is None:
            assert self.bm.block_table(seq_id) == table_before and self.bm.num_free_blocks == free_before
            return
        for src, dst in result.copies:
            assert src in table_before and dst not in table_before and self.bm.ref_count(src) >= 1
        self.tokens[seq_id] += [1] * grow
        self.bm.register_computed(seq_id, self.tokens[seq_id], len(self.tokens[seq_id]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        if self.bm.can_swap_out(seq_id):
            self.bm.swap_out(seq_id)
            self.swapped[seq_id] = self.tokens.pop(seq_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        if self.bm.swap_in(seq_id) is not None:
            self.tokens[seq_id] = self.swapped.pop(seq_id)

    @precondition(lambda self: self.tokens or self.swapped)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens | self.swapped)))
        self.bm.free(seq_id)
        self.tokens.pop(seq_id, None)
        self.swapped.pop(seq_id, None)

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        for seq_id, tokens in self.tokens.items():
            assert len(self.bm.block_table(seq_id)) == self.bm.blocks_for(len(tokens))
        for seq_id, tokens in self.swapped.items():
            assert len(self.bm.cpu_block_table(seq_id)) == self.bm.blocks_for(len(tokens))
        if not self.tokens:
            assert self.bm.num_free_blocks == 12
        self._check_usage()

    def _check_usage(self) -> None:
        """usage() against a count over every block of the pool: fullest holder's fill per used block,
        hashed free blocks, ref counts above one. Sequences claim fewer tokens than they hold, so that
        partly filled shared blocks occur."""
        num_tokens = {seq_id: max(0, len(t) - seq_id % 3) for seq_id, t in self.tokens.items()}
        filled: dict[int, int] = {}
        for seq_id in self.tokens:
            for i, block_id in enumerate(self.bm.block_table(seq_id)):
                fill = min(2, max(0, num_tokens[seq_id] - 2 * i))
                filled[block_id] = max(filled.get(block_id, 0), fill)
        refs = [self.bm.ref_count(b) for b in range(12)]
        usage = self.bm.usage(num_tokens)
        assert usage.slots_used == sum(filled.values())
        assert usage.blocks_shared == sum(1 for c in refs if c > 1)
        assert usage.blocks_saved == sum(c - 1 for c in refs if c > 1)
        assert usage.blocks_cached == sum(
            1 for b in range(12) if refs[b] == 0 and self.bm._hash_of[b] is not None
        )


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
