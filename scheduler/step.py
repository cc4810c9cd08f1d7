"""The plan being built: what one step changes on the worker, and the sequences it schedules."""

from __future__ import annotations

from common.messages import Fork, NewSequence, StepPlan
from scheduler.block_manager import Allocation, BlockManager
from scheduler.request import Sequence
from scheduler.settings import SchedulerSettings


class Step:
    """Collects a plan's changes while the scheduler's passes fill it; `plan()` makes the message."""

    def __init__(self, block_manager: BlockManager, settings: SchedulerSettings) -> None:
        self._block_manager = block_manager
        self._settings = settings
        self.new_seqs: list[NewSequence] = []
        self.new_block_ids: list[tuple[int, list[int]]] = []
        self.new_block_tables: list[tuple[int, list[int]]] = []
        self.block_copies: list[tuple[int, int]] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.forks: list[Fork] = []
        self.scheduled: list[tuple[Sequence, int]] = []  # (sequence, num_scheduled_tokens), in batch order
        self.preempted = False

    def allocate(self, seq: Sequence, num_tokens: int) -> Allocation | None:
        """Slots for `num_tokens` more of `seq` (the block manager's answer; `record_allocation` it)."""
        reserve = self._settings.reserve_tokens(seq)
        return self._block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_tokens, reserve)

    def record_allocation(self, seq: Sequence, allocation: Allocation) -> None:
        self.block_copies += allocation.copies
        if allocation.replaced:  # a private copy took a shared block's place
            self.new_block_tables.append((seq.seq_id, list(self._block_manager.block_table(seq.seq_id))))
        elif allocation.new_blocks:
            self.new_block_ids.append((seq.seq_id, allocation.new_blocks))

    def plan(
        self,
        step_id: int,
        sampling_seq_ids: list[int],
        freed_seq_ids: list[int],
        clones: list[tuple[int, int]],
        appended_tokens: list[tuple[int, int]],
    ) -> StepPlan:
        return StepPlan(
            step_id=step_id,
            freed_seq_ids=freed_seq_ids,
            new_seqs=self.new_seqs,
            new_block_ids=self.new_block_ids,
            scheduled_seq_ids=[seq.seq_id for seq, _ in self.scheduled],
            num_scheduled_tokens=[n for _, n in self.scheduled],
            sampling_seq_ids=sampling_seq_ids,
            swap_out=self.swap_out,
            swap_in=self.swap_in,
            new_block_tables=self.new_block_tables,
            block_copies=self.block_copies,
            forks=self.forks,
            clones=clones,
            appended_tokens=appended_tokens,
        )
