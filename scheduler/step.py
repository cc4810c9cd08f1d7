"""The plan being built: what one step changes on the worker, and the sequences it schedules. Once the
passes are done, `count_computed` applies the step to the sequences: their scheduled tokens count as
computed, full blocks go to the prefix cache, prompts that complete fork their children, and it says who
samples."""

from __future__ import annotations

from pagedserve.common.messages import Fork, NewSequence, StepPlan
from pagedserve.scheduler.block_manager import Allocation, BlockManager
from pagedserve.scheduler.kv_tiers import Transfers, tiers_of
from pagedserve.scheduler.queues import RunQueue
from pagedserve.scheduler.request import Sequence
from pagedserve.scheduler.settings import SchedulerSettings

_NO_TRANSFERS = Transfers()  # without tiers; only read


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
        self.spec_k = 0  # draft slots a decoding sequence may get (scheduler/speculation.py)
        self.draft_slots: list[tuple[int, int]] = []  # (seq_id, k)

    def allocate(self, seq: Sequence, num_tokens: int) -> Allocation | None:
        """Slots for `num_tokens` more of `seq` (the block manager's answer; `record_allocation` it)."""
        reserve = self._settings.reserve_tokens(seq)
        return self._block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_tokens, reserve)

    def record_allocation(self, seq: Sequence, allocation: Allocation) -> None:
        self.block_copies += allocation.copies
        if allocation.replaced:  # a private copy took a shared block's place
            self.new_block_tables.append((seq.seq_id, self._block_manager.wire_table(seq.seq_id)))
        elif allocation.new_blocks:
            self.new_block_ids.append((seq.seq_id, allocation.new_blocks))

    def count_computed(self, running: RunQueue) -> tuple[list[int], int]:
        """Counts the scheduled tokens as computed, registers the blocks they fill for the prefix cache and
        forks the children of prompts that complete. Returns who samples: the scheduled sequences that
        sample (the first `num_samplers`, in batch order), then their fork children."""
        bs = self._settings.block_size
        windowed = self._block_manager.sliding_window > 0
        sampling: list[int] = []
        num_samplers = 0
        for seq, num_tokens in self.scheduled:
            before = seq.num_computed_tokens
            num_computed_tokens = seq.num_computed_tokens = before + num_tokens
            num_known_tokens = len(seq.token_ids)
            samples = num_computed_tokens == num_known_tokens + seq.num_pending_tokens
            if samples:
                sampling.insert(num_samplers, seq.seq_id)
                num_samplers += 1
                if seq.request.beam is None:
                    seq.num_pending_tokens += 1
                else:  # a beam reports candidates; its next token comes from the search, after the update
                    seq.num_pending_reports += 1
            # A block filled up: cache it, once its tokens are all known (pending ones come with an update).
            if before // bs != num_computed_tokens // bs or num_computed_tokens > num_known_tokens:
                self._block_manager.register_computed(
                    seq.seq_id,
                    seq.token_ids,
                    min(num_computed_tokens, num_known_tokens),
                    seq.request.cache_salt,
                )
            # Sliding windows: blocks behind the window of this step's first query are read no more. (Not
            # this step's last: rejected drafts roll back to no earlier than `before`.)
            if windowed:
                self._block_manager.free_behind_window(seq.seq_id, before)
            if seq.fork_children and samples:
                sampling += [child.seq_id for child in seq.fork_children]
                self._fork_children(seq, running)
        return sampling, num_samplers

    def _fork_children(self, parent: Sequence, running: RunQueue) -> None:
        """The children share the parent's blocks and sample from its logits in this step."""
        for child in parent.fork_children:
            self._block_manager.fork(parent.seq_id, child.seq_id)
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.num_pending_tokens = 1  # it samples from the parent's logits in this step
            child.on_worker = True
            self.forks.append(Fork(parent.seq_id, child.seq_id, child.seed))
            running.add_forked(child)
        running.release_fork_seats(len(parent.fork_children))
        parent.fork_children = []

    def plan(
        self,
        step_id: int,
        sampling_seq_ids: list[int],
        freed_seq_ids: list[int],
        clones: list[tuple[int, int]],
        appended_tokens: list[tuple[int, int]],
    ) -> StepPlan:
        tiers = tiers_of(self._block_manager)
        transfers = tiers.take_transfers(step_id) if tiers is not None else _NO_TRANSFERS
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
            draft_slots=self.draft_slots,
            disk_writes=transfers.disk_writes,
            tier_offloads=transfers.offloads,
            disk_reads=transfers.disk_reads,
            tier_loads=transfers.loads,
        )
