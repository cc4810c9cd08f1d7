"""The block manager: on-demand allocation, all-or-nothing growth, every block back on free."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from scheduler.block_manager import BlockManager


def test_allocates_blocks_on_demand_as_the_sequence_grows():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert bm.allocate(0, 1) is not None and len(bm.block_table(0)) == 1
    assert bm.allocate(0, 4) == []  # the first block still has room
    assert len(bm.allocate(0, 5)) == 1
    assert len(bm.allocate(0, 13)) == 2
    assert len(bm.block_table(0)) == 4 and bm.num_free_blocks == 4
    bm.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 8)
    before = (list(bm.block_table(0)), bm.num_free_blocks)
    assert bm.allocate(1, 12) is None
    assert bm.allocate(0, 20) is None
    assert (list(bm.block_table(0)), bm.num_free_blocks) == before
    assert bm.block_table(1) == []
    bm.check_invariants()


def test_free_returns_every_block_and_blocks_are_never_shared():
    bm = BlockManager(num_blocks=10, block_size=2)
    for seq_id, n in enumerate([3, 5, 1, 7]):
        bm.allocate(seq_id, n)
    tables = [bm.block_table(s) for s in range(4)]
    flat = [b for t in tables for b in t]
    assert len(flat) == len(set(flat)) == 2 + 3 + 1 + 4
    for seq_id in range(4):
        bm.free(seq_id)
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_invariant_check_catches_a_corrupted_free_list():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(0, 4)
    bm._free.append(bm.block_table(0)[0])  # the block is now both used and free
    with pytest.raises(AssertionError):
        bm.check_invariants()


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / grow / free sequences against a simple model of what each table must hold."""

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(num_blocks=16, block_size=4)
        self.lengths: dict[int, int] = {}  # seq_id -> tokens its table must cover
        self.next_id = 0

    @rule(num_tokens=st.integers(1, 40))
    def new_sequence(self, num_tokens: int) -> None:
        fits = self.bm.blocks_for(num_tokens) <= self.bm.num_free_blocks
        added = self.bm.allocate(self.next_id, num_tokens)
        assert (added is not None) == fits
        if added is not None:
            self.lengths[self.next_id] = num_tokens
        self.next_id += 1

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), grow=st.integers(1, 20))
    def grow(self, data: st.DataObject, grow: int) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.lengths)))
        free_before = self.bm.num_free_blocks
        table_before = list(self.bm.block_table(seq_id))
        added = self.bm.allocate(seq_id, self.lengths[seq_id] + grow)
        if added is None:
            assert self.bm.num_free_blocks == free_before and self.bm.block_table(seq_id) == table_before
        else:
            assert self.bm.block_table(seq_id) == table_before + added
            self.lengths[seq_id] += grow

    @precondition(lambda self: self.lengths)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.lengths)))
        self.bm.free(seq_id)
        del self.lengths[seq_id]

    @invariant()
    def consistent(self) -> None:
        self.bm.check_invariants()
        for seq_id, n in self.lengths.items():
            assert len(self.bm.block_table(seq_id)) == self.bm.blocks_for(n)
        used = sum(self.bm.blocks_for(n) for n in self.lengths.values())
        assert self.bm.num_free_blocks == 16 - used


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
