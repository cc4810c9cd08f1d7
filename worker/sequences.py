"""The worker's sequences: each one's tokens, computed-token count, sampling settings, tokens in flight and
block table, and a StepPlan's changes to them, checked whole (worker/plan_check.py) and then applied in the
StepPlan order (common/messages.py).

Each sequence has ONE block table: a row of `BlockTableArray`, the numpy array that every step's inputs
are cut from (worker/inputs.py); the sequence keeps only its row's index. A sequence owns its row from the
moment the worker learns of it until it is freed; the plan's changes (new blocks, a new table after a
swap-in, clones and forks) edit that row in place, so the host work of applying a plan grows with the plan's
changes, not with the batch or the tables' lengths.

Block ids come from the scheduler, which owns their ref counts; the worker only reads and writes where they
point. The KV pools themselves are the runner's (worker/kv_cache.py): `apply` is handed them to do the
plan's swaps and copies at their place in the order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from pagedserve.common.messages import NewSequence, SamplingParams, StepPlan
from pagedserve.worker.plan_check import PlanError, PlanLimits, check_changes, check_plan, check_step


class BlockTableArray:
    """Rows of block ids, `[num_rows, max_blocks_per_seq]` int32, one per live sequence, and the pool of
    free rows."""

    def __init__(self, max_blocks_per_seq: int, initial_rows: int = 64) -> None:
        self.max_blocks_per_seq = max_blocks_per_seq
        self.tables = np.zeros((initial_rows, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(initial_rows, dtype=np.int32)  # [num_rows] blocks held by each row
        self._free_rows = list(range(initial_rows - 1, -1, -1))

    def _grow(self) -> None:
        old = self.tables.shape[0]
        self.tables = np.concatenate([self.tables, np.zeros_like(self.tables)])
        self.num_blocks = np.concatenate([self.num_blocks, np.zeros_like(self.num_blocks)])
        self._free_rows.extend(range(2 * old - 1, old - 1, -1))

    def add(self, block_ids: list[int]) -> int:
        """A new row holding `block_ids`; returns its index."""
        if not self._free_rows:
            self._grow()
        row = self._free_rows.pop()
        self.set(row, block_ids)
        return row

    def set(self, row: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        self._check_width(n)
        self.tables[row, :n] = block_ids
        self.num_blocks[row] = n

    def extend(self, row: int, block_ids: list[int]) -> None:
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        self._check_width(end)
        self.tables[row, start:end] = block_ids
        self.num_blocks[row] = end

    def copy_row(self, src: int) -> int:
        """A new row with the same blocks as `src` (a clone or fork child); returns its index."""
        row = self.add([])
        n = int(self.num_blocks[src])
        self.tables[row, :n] = self.tables[src, :n]
        self.num_blocks[row] = n
        return row

    def row(self, row: int) -> list[int]:
        """The block ids of `row`, as a list (for tests and messages: a step reads the array)."""
        return self.tables[row, : self.num_blocks[row]].tolist()

    def free(self, row: int) -> None:
        self.num_blocks[row] = 0
        self._free_rows.append(row)

    def _check_width(self, n: int) -> None:
        if n > self.max_blocks_per_seq:
            raise ValueError(f"a block table of {n} blocks exceeds max_model_len ({self.max_blocks_per_seq})")


@dataclass
class SeqState:
    """The worker's copy of one sequence; its block table is row `row` of the `Sequences`' array."""

    token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams  # what the sampler reads (worker/sampler.py SamplingTensors.from_params)
    seed: int
    num_logprobs: int  # params.num_logprobs, kept for the step's host work
    row: int  # this sequence's row in the BlockTableArray: its block table
    beam: bool = False  # report candidates, append nothing: the scheduler chooses the beam's tokens
    pending: int = 0  # tokens sampled by a launched step that has not finished: not in token_ids yet
    prompt_len: int = 0  # token_ids[:prompt_len] is the prompt, the rest was generated
    processed: bool = False  # params.processed, kept for the step's host work (worker/logits_processors.py)

    @classmethod
    def from_new(cls, s: NewSequence, row: int) -> SeqState:
        return cls(
            list(s.token_ids),
            s.num_computed_tokens,
            s.params,
            s.seed,
            s.params.num_logprobs,
            row,
            s.params.beam,
            prompt_len=len(s.token_ids) - s.num_output_tokens,
            processed=s.params.processed,
        )


class BlockMover(Protocol):
    """The KV pools' side of a plan (worker/kv_cache.py KVPools): each takes (source, destination) pairs."""

    def swap_out(self, pairs: list[tuple[int, int]]) -> None: ...

    def swap_in(self, pairs: list[tuple[int, int]]) -> None: ...

    def copy(self, pairs: list[tuple[int, int]]) -> None: ...

    def move_tiers(self, plan: StepPlan) -> None: ...


class Sequences:
    """Every live sequence of the worker by seq id, and the block table array that holds their tables.

    A step goes: `check_plan` (refuses a bad plan before any change), `apply` (steps 0 to 4), `computed`
    (step 5, once the forward is queued), `fork` (step 6), `sampled` (step 7: a token is now in flight for
    each sampler) and, when the step's tokens reach the host, `received`."""

    def __init__(self, limits: PlanLimits) -> None:
        self.limits = limits
        self.seqs: dict[int, SeqState] = {}
        self.tables = BlockTableArray(limits.max_blocks_per_seq)

    def block_table(self, seq_id: int) -> list[int]:
        return self.tables.row(self.seqs[seq_id].row)

    def clear(self) -> None:
        """Forgets every sequence; rows are handed out again from the first, as on a new worker."""
        self.seqs.clear()
        self.tables = BlockTableArray(self.limits.max_blocks_per_seq)

    def check_plan(self, plan: StepPlan) -> str | None:
        """Why `plan` contradicts these sequences as they will be when it is applied (after the step in
        flight, if any), or None when `apply` can apply it. Changes nothing. Call it between launches, not
        between one step's `apply` and its `sampled` (its fork children and pending tokens do not exist
        yet)."""
        return check_plan(plan, self.seqs, self.tables.num_blocks, self.limits)

    def apply(self, plan: StepPlan, kv: BlockMover) -> list[SeqState]:
        """Steps 0 to 4 of the StepPlan order, then the checks of the step itself (5 to 7) against the
        changed sequences; returns the scheduled sequences, in batch order. Raises PlanError: before any
        change when a change is bad, after the changes when only the step is (a bad plan is a scheduler
        bug, after which the worker starts over; `check_plan` is what refuses one whole)."""
        _raise(check_changes(plan, self.seqs, self.tables.num_blocks, self.limits))
        seqs, tables = self.seqs, self.tables
        for parent_id, child_id in plan.clones:
            parent = seqs[parent_id]
            seqs[child_id] = replace(
                parent, token_ids=list(parent.token_ids), row=tables.copy_row(parent.row)
            )
        for seq_id, token in plan.appended_tokens:
            seqs[seq_id].token_ids.append(token)
        for seq_id in plan.freed_seq_ids:
            tables.free(seqs.pop(seq_id).row)
        if plan.disk_writes or plan.tier_offloads or plan.disk_reads or plan.tier_loads:
            kv.move_tiers(plan)  # before anything writes a block they read (docs/kv_tiers.md)
        kv.swap_out(plan.swap_out)
        kv.swap_in(plan.swap_in)
        for seq_id, table in plan.new_block_tables:
            tables.set(seqs[seq_id].row, table)
        for new in plan.new_seqs:
            seqs[new.seq_id] = SeqState.from_new(new, tables.add(new.block_table))
        for seq_id, block_ids in plan.new_block_ids:
            tables.extend(seqs[seq_id].row, block_ids)
        kv.copy(plan.block_copies)
        _raise(check_step(plan, seqs, tables.num_blocks, self.limits))
        return [seqs[seq_id] for seq_id in plan.scheduled_seq_ids]

    @staticmethod
    def computed(scheduled: list[SeqState], num_tokens: Sequence[int]) -> None:
        """Step 5: the scheduled sequences' tokens are computed (their forward is queued)."""
        for seq, n in zip(scheduled, num_tokens, strict=True):
            seq.num_computed_tokens += n

    def fork(self, plan: StepPlan) -> list[SeqState]:
        """Step 6: each fork's child starts as its parent after the forward (tokens, computed count, a row of
        the same, shared blocks) with its own seed. Returns the children, in plan order."""
        children = []
        for fork in plan.forks:
            parent = self.seqs[fork.parent_seq_id]
            child = replace(
                parent,
                token_ids=list(parent.token_ids),
                seed=fork.seed,
                row=self.tables.copy_row(parent.row),
            )
            self.seqs[fork.child_seq_id] = child
            children.append(child)
        return children

    @staticmethod
    def sampled(samplers: list[SeqState]) -> None:
        """Step 7 is queued: each sampler has a token in flight, pending until `received` (a beam appends
        none: the scheduler chooses its tokens)."""
        for seq in samplers:
            if not seq.beam:
                seq.pending += 1

    @staticmethod
    def received(samplers: list[SeqState], token_ids: list[int]) -> None:
        """The tokens of a step that `sampled` reached the host: each joins its sequence's tokens. A sequence
        freed meanwhile is no longer in `seqs`; its state, still held here, takes the token harmlessly."""
        for seq, token in zip(samplers, token_ids, strict=True):
            if not seq.beam:
                seq.token_ids.append(token)
                seq.pending -= 1


def _raise(problem: str | None) -> None:
    if problem is not None:
        raise PlanError(problem)
