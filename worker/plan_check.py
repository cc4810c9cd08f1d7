"""A StepPlan checked against the worker's sequences before it is applied: the one place that knows what
makes a plan valid (worker/sequences.py applies the plan's changes only once they passed).

`check_plan` walks the StepPlan order over a shadow of only the sequences the plan touches and changes
nothing, so that the worker can refuse a plan whole and still hold exactly the state it had. Its two halves,
`check_changes` (steps 0 to 4) and `check_step` (5 to 7), are what `Sequences.apply` runs before and after
applying the changes.

With a step in flight (launched, not finished) a sequence that samples in it counts the token on its way as
pending: `len(token_ids) + pending` is what the sequence will know when this plan is applied, whether or not
the step finishes first. Call it between launches, not between one step's `launch_forward` and its
`launch_sampling` (the fork children and pending tokens of that step do not exist yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from pagedserve.common.messages import StepPlan


@dataclass(frozen=True)
class PlanLimits:
    """The runner's sizes that every id and count in a plan must fit."""

    num_kv_blocks: int  # device pool
    num_cpu_blocks: int  # swap pool
    vocab_size: int
    block_size: int
    max_model_len: int
    max_blocks_per_seq: int  # the width of the runner's block table array
    num_host_tier_blocks: int = 0  # KV tiers (worker/kv_tiers/): host memory slots
    num_disk_tier_blocks: int = 0  # disk slots


class SeqView(Protocol):
    """What the check reads of one of the worker's sequences (worker/sequences.py SeqState)."""

    token_ids: list[int]
    num_computed_tokens: int
    pending: int  # tokens sampled by the step in flight and not yet appended
    row: int  # its row of the block table array: `num_blocks[row]` blocks


@dataclass(slots=True)
class _Shadow:
    """What the check needs of one sequence, as the plan changes it."""

    num_known: int  # tokens the sequence knows, a pending one included
    num_computed: int
    num_blocks: int
    pending: int  # tokens sampled by the step in flight and not yet appended


class _Walk:
    """The runner's sequences with the plan's changes laid over them; the runner's own are only read."""

    def __init__(self, seqs: Mapping[int, SeqView], num_blocks: np.ndarray) -> None:
        self.seqs = seqs
        self.num_blocks = num_blocks
        self.changed: dict[int, _Shadow | None] = {}  # None: freed by the plan

    def get(self, seq_id: int) -> _Shadow | None:
        if seq_id in self.changed:
            return self.changed[seq_id]
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        num_known = len(seq.token_ids) + seq.pending
        return _Shadow(num_known, seq.num_computed_tokens, int(self.num_blocks[seq.row]), seq.pending)

    def edit(self, seq_id: int) -> _Shadow | None:
        """The sequence's shadow, kept in `changed` so that later parts of the plan see the edits."""
        shadow = self.get(seq_id)
        if shadow is not None:
            self.changed[seq_id] = shadow
        return shadow


class PlanError(ValueError):
    """A StepPlan that contradicts the worker's state: a bug in the scheduler."""


def check_plan(
    plan: StepPlan, seqs: Mapping[int, SeqView], num_blocks: np.ndarray, limits: PlanLimits
) -> str | None:
    """Why `plan` cannot be applied to the sequences `seqs`, whose rows hold `num_blocks` blocks each
    (`[num_rows]`), of a runner of `limits`; or None when it can."""
    walk = _Walk(seqs, num_blocks)
    return _named(plan, _check_changes(plan, walk, limits) or _check_step(plan, walk, limits))


def check_changes(
    plan: StepPlan, seqs: Mapping[int, SeqView], num_blocks: np.ndarray, limits: PlanLimits
) -> str | None:
    """`check_plan` of steps 0 to 4 alone (the plan's changes to the sequences and the pools)."""
    return _named(plan, _check_changes(plan, _Walk(seqs, num_blocks), limits))


def check_step(
    plan: StepPlan, seqs: Mapping[int, SeqView], num_blocks: np.ndarray, limits: PlanLimits
) -> str | None:
    """`check_plan` of steps 5 to 7 alone (what the step computes and samples, and its forks), against
    sequences that the plan's changes were applied to."""
    return _named(plan, _check_step(plan, _Walk(seqs, num_blocks), limits))


def _named(plan: StepPlan, problem: str | None) -> str | None:
    return None if problem is None else f"step {plan.step_id}: {problem}"


def _check_changes(plan: StepPlan, walk: _Walk, limits: PlanLimits) -> str | None:
    """Steps 0 to 4 of the StepPlan order."""
    for parent_id, child_id in plan.clones:
        parent = walk.get(parent_id)
        if parent is None:
            return f"clone parent {parent_id} is unknown"
        if parent.pending:
            return f"clone parent {parent_id} has a sampled token in flight (the clone would miss it)"
        if walk.get(child_id) is not None:
            return f"clone {child_id} already exists"
        walk.changed[child_id] = replace(parent)
    for seq_id, token in plan.appended_tokens:
        if not 0 <= token < limits.vocab_size:
            return f"appended token {token} is outside the vocab"
        seq = walk.edit(seq_id)
        if seq is None:
            return f"appended token for unknown sequence {seq_id}"
        if seq.pending:
            return f"appended token for sequence {seq_id} would go before its token in flight"
        seq.num_known += 1
    for seq_id in plan.freed_seq_ids:
        if walk.get(seq_id) is None:
            return f"freed sequence {seq_id} is unknown"
        walk.changed[seq_id] = None

    problem = (
        _tier_pairs(plan, limits)
        or _pairs("swap_out", plan.swap_out, limits.num_kv_blocks, limits.num_cpu_blocks)
        or _pairs("swap_in", plan.swap_in, limits.num_cpu_blocks, limits.num_kv_blocks)
    )
    if problem:
        return problem
    for seq_id, table in plan.new_block_tables:
        seq = walk.edit(seq_id)
        if seq is None:
            return f"new block table for unknown sequence {seq_id}"
        if problem := _blocks(seq_id, table, len(table), limits):
            return problem
        seq.num_blocks = len(table)

    for new in plan.new_seqs:
        if walk.get(new.seq_id) is not None:
            return f"new sequence {new.seq_id} already exists"
        if not 0 <= new.num_computed_tokens <= len(new.token_ids):
            return f"sequence {new.seq_id} has bad num_computed_tokens"
        if new.num_computed_tokens > len(new.block_table) * limits.block_size:
            return f"sequence {new.seq_id} has {new.num_computed_tokens} computed tokens but few blocks"
        if not new.num_output_tokens < len(new.token_ids):
            return f"sequence {new.seq_id} has no prompt ({new.num_output_tokens} output tokens of all)"
        if new.token_ids and not 0 <= min(new.token_ids) <= max(new.token_ids) < limits.vocab_size:
            return f"sequence {new.seq_id} has token ids outside the vocab"
        if not -1 <= new.params.num_logprobs <= limits.vocab_size:
            return f"sequence {new.seq_id} asks for {new.params.num_logprobs} logprobs"
        if problem := _blocks(new.seq_id, new.block_table, len(new.block_table), limits):
            return problem
        shadow = _Shadow(len(new.token_ids), new.num_computed_tokens, len(new.block_table), pending=0)
        walk.changed[new.seq_id] = shadow
    for seq_id, block_ids in plan.new_block_ids:
        seq = walk.edit(seq_id)
        if seq is None:
            return f"new blocks for unknown sequence {seq_id}"
        if problem := _blocks(seq_id, block_ids, seq.num_blocks + len(block_ids), limits):
            return problem
        seq.num_blocks += len(block_ids)

    if problem := _pairs("block_copies", plan.block_copies, limits.num_kv_blocks, limits.num_kv_blocks):
        return problem
    if {src for src, _ in plan.block_copies} & {dst for _, dst in plan.block_copies}:
        return "block_copies writes a block it also reads"
    return None


def _check_step(plan: StepPlan, walk: _Walk, limits: PlanLimits) -> str | None:
    """Steps 5 to 7: the scheduled sequences' tokens and slots, who samples, and the forks."""
    scheduled = plan.scheduled_seq_ids
    if len(scheduled) != len(plan.num_scheduled_tokens):
        return "scheduled_seq_ids and num_scheduled_tokens lengths differ"
    if len(set(scheduled)) != len(scheduled):
        return "a sequence is scheduled twice"
    # This loop runs every step over the whole batch: the runner's sequences are read in place (their rows'
    # lengths as one list: a Python list reads faster than a numpy scalar), and the reason is worked out
    # only for a sequence that fails.
    sampling: dict[int, int] = {}  # the scheduled sequences that reach all their tokens -> their pending ones
    changed, seqs, block_size, max_len = walk.changed, walk.seqs, limits.block_size, limits.max_model_len
    blocks_of_row = walk.num_blocks.tolist()
    for seq_id, n in zip(scheduled, plan.num_scheduled_tokens, strict=True):
        if seq_id in changed or seq_id not in seqs:
            shadow = walk.get(seq_id)
            if shadow is None:
                return f"scheduled sequence {seq_id} is unknown"
            known, computed = shadow.num_known, shadow.num_computed
            num_blocks, pending = shadow.num_blocks, shadow.pending
        else:
            seq = seqs[seq_id]
            pending, computed, num_blocks = seq.pending, seq.num_computed_tokens, blocks_of_row[seq.row]
            known = len(seq.token_ids) + pending
        end = computed + n
        if n < 1 or end > known or (pending and n != 1) or end > max_len or num_blocks * block_size < end:
            return _scheduled_problem(seq_id, n, known, computed, num_blocks, pending, limits)
        if end == known:
            sampling[seq_id] = pending
    if problem := _sampling_problem(plan, sampling):
        return problem
    sampling = {seq_id: sampling[seq_id] for seq_id in plan.sampling_seq_ids}

    children = [fork.child_seq_id for fork in plan.forks]
    if len(set(children)) != len(children):
        return "a fork child id appears twice"
    for fork in plan.forks:
        parent_pending = sampling.get(fork.parent_seq_id)
        if parent_pending is None:
            return f"fork parent {fork.parent_seq_id} does not sample this step"
        if parent_pending:
            # The child would count the parent's token in flight as its own, and never receive it.
            return f"fork parent {fork.parent_seq_id} has a sampled token in flight"
        if walk.get(fork.child_seq_id) is not None:
            return f"fork child {fork.child_seq_id} already exists"
    return None


def _sampling_problem(plan: StepPlan, reach_end: dict[int, int]) -> str | None:
    """`sampling_seq_ids`: scheduled up to all their known tokens (`reach_end`), once each, in batch order."""
    sampling = plan.sampling_seq_ids
    for seq_id in sampling:
        if seq_id not in reach_end:
            return f"sampling sequence {seq_id} is not scheduled up to all its tokens"
    position = {seq_id: b for b, seq_id in enumerate(plan.scheduled_seq_ids)}
    if any(position[a] >= position[b] for a, b in zip(sampling, sampling[1:], strict=False)):
        return "sampling_seq_ids is not in batch order (or names a sequence twice)"
    return None


def _scheduled_problem(
    seq_id: int, n: int, known: int, computed: int, num_blocks: int, pending: int, limits: PlanLimits
) -> str:
    end = computed + n
    if n < 1 or end > known:
        return f"sequence {seq_id} scheduled {n} tokens from {computed} but knows {known}"
    if pending and n != 1:
        return f"sequence {seq_id} has a token pending, computes {n}"
    if end > limits.max_model_len:
        return f"sequence {seq_id} reaches {end} > max_model_len"
    return f"sequence {seq_id} needs {end} slots but its block table has {num_blocks} blocks"


def _pairs(name: str, pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> str | None:
    """Source ids inside their pool, destination ids inside theirs and distinct (one write per block)."""
    for src, dst in pairs:
        if not (0 <= src < num_src and 0 <= dst < num_dst):
            return f"{name} pair ({src}, {dst}) is outside the pools ({num_src} -> {num_dst} blocks)"
    if len({dst for _, dst in pairs}) != len(pairs):
        return f"{name} writes a block twice"
    return None


def _tier_pairs(plan: StepPlan, limits: PlanLimits) -> str | None:
    """The KV tiers' copies inside their pools (none where the worker has no tiers)."""
    host, disk, device = limits.num_host_tier_blocks, limits.num_disk_tier_blocks, limits.num_kv_blocks
    return (
        _pairs("disk_writes", plan.disk_writes, host, disk)
        or _pairs("tier_offloads", plan.tier_offloads, device, host)
        or _pairs("disk_reads", plan.disk_reads, disk, host)
        or _pairs("tier_loads", plan.tier_loads, host, device)
    )


def _blocks(seq_id: int, block_ids: list[int], table_len: int, limits: PlanLimits) -> str | None:
    """`block_ids` inside the device pool, and a table of `table_len` blocks that fits the runner's rows."""
    if block_ids and not 0 <= min(block_ids) <= max(block_ids) < limits.num_kv_blocks:
        return f"sequence {seq_id} got block ids outside the KV pool"
    if table_len > limits.max_blocks_per_seq:
        return f"sequence {seq_id} would hold {table_len} blocks, past max_model_len"
    return None
