"""worker/sequences.py without a model: a plan's changes applied to the worker's sequences in the StepPlan
order, one block table per sequence (a row of the block table array), forks and clones on rows of their
own, the pending-token counts of a step in flight, and a bad plan refused."""

from __future__ import annotations

from typing import Any

import pytest

from pagedserve.common.messages import Fork, NewSequence, SamplingParams, StepPlan
from pagedserve.worker.plan_check import PlanError, PlanLimits
from pagedserve.worker.sequences import SeqState, Sequences

LIMITS = PlanLimits(
    num_kv_blocks=32, num_cpu_blocks=8, vocab_size=100, block_size=4, max_model_len=64, max_blocks_per_seq=16
)


class RecordingPools:
    """A BlockMover that records the pools' operations, in order, with the sequences' rows at that time."""

    def __init__(self, sequences: Sequences) -> None:
        self.sequences = sequences
        self.calls: list[tuple[str, list[tuple[int, int]], dict[int, list[int]]]] = []

    def _record(self, name: str, pairs: list[tuple[int, int]]) -> None:
        tables = {seq_id: self.sequences.block_table(seq_id) for seq_id in self.sequences.seqs}
        self.calls.append((name, list(pairs), tables))

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self._record("swap_out", pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self._record("swap_in", pairs)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self._record("copy", pairs)


def new_seq(seq_id: int, num_tokens: int, table: list[int], seed: int = 0, beam: bool = False) -> NewSequence:
    params = SamplingParams(temperature=0.0, beam_width=2 if beam else 0)
    return NewSequence(seq_id, list(range(1, num_tokens + 1)), table, 0, params, seed)


def plan(step_id: int = 100, schedule: dict[int, int] | None = None, **fields: Any) -> StepPlan:
    """A plan in which every scheduled sequence samples unless `sampling_seq_ids` says otherwise."""
    schedule = schedule or {}
    return StepPlan(
        step_id,
        fields.pop("freed_seq_ids", []),
        fields.pop("new_seqs", []),
        fields.pop("new_block_ids", []),
        list(schedule),
        list(schedule.values()),
        fields.pop("sampling_seq_ids", list(schedule)),
        **fields,
    )


def _step(sequences: Sequences, p: StepPlan) -> list[SeqState]:
    """Steps 0 to 7 of `p` with the tokens of its samplers received at once (token 7 each)."""
    assert sequences.check_plan(p) is None
    scheduled = sequences.apply(p, RecordingPools(sequences))
    sequences.computed(scheduled, p.num_scheduled_tokens)
    samplers = [sequences.seqs[seq_id] for seq_id in p.sampling_seq_ids] + sequences.fork(p)
    sequences.sampled(samplers)
    sequences.received(samplers, [7] * len(samplers))
    return scheduled


def _snapshot(sequences: Sequences) -> tuple:
    seqs = {
        seq_id: (list(s.token_ids), s.num_computed_tokens, s.pending, s.row, sequences.block_table(seq_id))
        for seq_id, s in sequences.seqs.items()
    }
    return seqs, sequences.tables.tables.tobytes(), sequences.tables.num_blocks.tobytes()


def test_a_sequence_holds_one_block_table_its_row_which_the_plans_changes_edit() -> None:
    """The block table lives only in the array (the rows the kernels read); a sequence keeps its row."""
    assert "block_table" not in SeqState.__dataclass_fields__
    sequences = Sequences(LIMITS)
    _step(sequences, plan(0, {1: 6, 2: 3}, new_seqs=[new_seq(1, 6, [4, 5]), new_seq(2, 3, [9])]))
    assert sequences.block_table(1) == [4, 5] and sequences.block_table(2) == [9]
    row = sequences.seqs[1].row
    assert sequences.tables.tables[row, :2].tolist() == [4, 5]

    _step(sequences, plan(1, {1: 1, 2: 1}, new_block_ids=[(1, [6]), (2, [10])]))
    assert sequences.block_table(1) == [4, 5, 6] and sequences.seqs[1].row == row
    assert sequences.seqs[1].token_ids == [1, 2, 3, 4, 5, 6, 7, 7]
    assert sequences.seqs[1].num_computed_tokens == 7 and sequences.seqs[1].pending == 0

    _step(sequences, plan(2, new_block_tables=[(2, [20, 21])]))  # a swapped-in sequence's new blocks
    assert sequences.block_table(2) == [20, 21]


def test_freed_rows_are_reused_and_clear_starts_the_rows_over() -> None:
    sequences = Sequences(LIMITS)
    _step(sequences, plan(0, new_seqs=[new_seq(1, 4, [1]), new_seq(2, 4, [2])]))
    freed_row = sequences.seqs[1].row
    _step(sequences, plan(1, freed_seq_ids=[1], new_seqs=[new_seq(3, 4, [3])]))
    assert 1 not in sequences.seqs and sequences.seqs[3].row == freed_row
    assert sequences.block_table(3) == [3]
    first_row = Sequences(LIMITS).tables.add([])
    sequences.clear()
    assert not sequences.seqs
    _step(sequences, plan(2, new_seqs=[new_seq(1, 4, [5])]))
    assert sequences.seqs[1].row == first_row


def test_changes_apply_in_the_stepplan_order_with_the_pools_at_their_place() -> None:
    """Clones, then appended tokens, then frees; swap out, swap in, new tables; new sequences and blocks;
    block copies last."""
    sequences = Sequences(LIMITS)
    _step(sequences, plan(0, {1: 4, 2: 4}, new_seqs=[new_seq(1, 4, [1]), new_seq(2, 4, [2])]))
    pools = RecordingPools(sequences)
    p = plan(
        1,
        clones=[(1, 5)],
        appended_tokens=[(5, 9)],
        freed_seq_ids=[1],
        swap_out=[(2, 0)],
        swap_in=[(1, 3)],
        new_block_tables=[(2, [3])],
        new_seqs=[new_seq(6, 2, [7])],
        new_block_ids=[(5, [8])],
        block_copies=[(1, 11)],
    )
    assert sequences.check_plan(p) is None
    assert sequences.apply(p, pools) == []
    names = [name for name, _, _ in pools.calls]
    assert names == ["swap_out", "swap_in", "copy"]
    at_swap_out, at_copy = pools.calls[0][2], pools.calls[2][2]
    assert at_swap_out == {2: [2], 5: [1]}, "the clone exists and its parent is freed before the swaps"
    assert at_copy == {2: [3], 5: [1, 8], 6: [7]}, "tables, new sequences and blocks before the copies"
    assert sequences.seqs[5].token_ids == [1, 2, 3, 4, 7, 9]  # the parent's tokens, then the appended one


def test_clones_and_fork_children_get_rows_of_their_own_with_the_same_blocks() -> None:
    sequences = Sequences(LIMITS)
    _step(sequences, plan(0, {1: 5}, new_seqs=[new_seq(1, 5, [1, 2], seed=3)], forks=[Fork(1, 2, 44)]))
    parent, child = sequences.seqs[1], sequences.seqs[2]
    assert child.row != parent.row and sequences.block_table(2) == [1, 2]
    assert child.seed == 44 and parent.seed == 3
    assert child.token_ids == parent.token_ids == [1, 2, 3, 4, 5, 7]
    assert child.token_ids is not parent.token_ids
    assert child.num_computed_tokens == 5
    # Copy-on-write: the child's row changes, the parent's does not.
    _step(sequences, plan(1, {1: 1, 2: 1}, block_copies=[(2, 9)], new_block_tables=[(2, [1, 9])]))
    assert sequences.block_table(1) == [1, 2] and sequences.block_table(2) == [1, 9]
    _step(sequences, plan(2, clones=[(2, 3)]))
    assert sequences.block_table(3) == [1, 9] and sequences.seqs[3].row not in (parent.row, child.row)


def test_a_token_in_flight_is_pending_until_received_and_a_beam_appends_none() -> None:
    sequences = Sequences(LIMITS)
    p = plan(0, {1: 4, 2: 4}, new_seqs=[new_seq(1, 4, [1, 2]), new_seq(2, 4, [3], beam=True)])
    scheduled = sequences.apply(p, RecordingPools(sequences))
    sequences.computed(scheduled, p.num_scheduled_tokens)
    sequences.sampled(scheduled)
    assert [s.pending for s in scheduled] == [1, 0]
    # The next plan counts the pending token as known: one decode of it is valid, two tokens are not.
    assert sequences.check_plan(plan(1, {1: 1})) is None
    assert "knows 5" in (sequences.check_plan(plan(1, {1: 2})) or "")
    sequences.received(scheduled, [11, 12])
    assert sequences.seqs[1].token_ids == [1, 2, 3, 4, 11] and sequences.seqs[1].pending == 0
    assert sequences.seqs[2].token_ids == [1, 2, 3, 4]  # the scheduler chooses a beam's tokens


def test_a_bad_change_is_refused_before_any_change() -> None:
    sequences = Sequences(LIMITS)
    _step(sequences, plan(0, {1: 4}, new_seqs=[new_seq(1, 4, [1])]))
    before = _snapshot(sequences)
    pools = RecordingPools(sequences)
    bad = plan(1, freed_seq_ids=[1], new_seqs=[new_seq(2, 4, [2])], new_block_ids=[(9, [3])])
    assert "unknown sequence 9" in (sequences.check_plan(bad) or "")
    with pytest.raises(PlanError, match="step 1: new blocks for unknown sequence 9"):
        sequences.apply(bad, pools)
    assert _snapshot(sequences) == before and pools.calls == []


def test_a_bad_step_is_refused_by_check_plan_and_raises_from_apply_after_the_changes() -> None:
    """check_plan refuses the plan whole; `apply` checks the step (5 to 7) against the changed sequences,
    as the runner always did."""
    sequences = Sequences(LIMITS)
    bad = plan(0, {1: 9}, new_seqs=[new_seq(1, 9, [1])])  # 9 tokens in one block of 4
    assert "needs 9 slots" in (sequences.check_plan(bad) or "")
    assert not sequences.seqs
    with pytest.raises(PlanError, match="needs 9 slots"):
        sequences.apply(bad, RecordingPools(sequences))
    assert sequences.block_table(1) == [1]


def test_sampling_ids_that_break_the_contract_are_refused() -> None:
    """The plan says who samples (docs/scheduler.md, "Who samples"); the worker checks it."""
    sequences = Sequences(LIMITS)
    news = [new_seq(1, 4, [1, 2]), new_seq(2, 8, [3, 4])]
    _step(sequences, plan(0, {1: 4, 2: 4}, new_seqs=news, sampling_seq_ids=[1]))
    assert "not scheduled" in (sequences.check_plan(plan(1, {1: 1}, sampling_seq_ids=[2])) or "")
    assert "batch order" in (sequences.check_plan(plan(1, {1: 1, 2: 4}, sampling_seq_ids=[2, 1])) or "")
    # Sequence 2 computes 4 of its 8 prompt tokens: it cannot sample, but may run without sampling.
    assert "not scheduled up to all its tokens" in (sequences.check_plan(plan(1, {2: 3})) or "")
    assert sequences.check_plan(plan(1, {2: 3}, sampling_seq_ids=[])) is None
