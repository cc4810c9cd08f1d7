"""ModelRunner.check_plan refuses every kind of bad plan before any of it is applied, accounts for the step in
flight, and ModelRunner.reset leaves a runner that serves a fresh plan as a new one would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import torch

from pagedserve.common.messages import Fork, SamplingParams, StepPlan
from pagedserve.worker.model_runner import ModelRunner
from tests.test_model_runner_kv import make_runner, new_seq, random_prompt
from tests.test_sequences import plan

NUM_BLOCKS = 16
NUM_CPU_BLOCKS = 8
MAX_BLOCKS_PER_SEQ = 2048 // 16  # the tiny model's positions over the block size


def _checked_execute(runner: ModelRunner, p: StepPlan):
    assert runner.check_plan(p) is None
    return runner.execute(p)


@pytest.fixture(scope="module")
def runner(tiny_model_dir: Path) -> ModelRunner:
    """Sequence 10: a 20-token prompt in blocks [0, 1], prefilled, one token sampled (21 known, 20 computed).
    Sequence 11: a 5-token prompt in block [2], prefilled likewise (6 known, 5 computed). Tests that change
    its state make their own runner; the bad-plan tests only check against it."""
    r = make_runner(tiny_model_dir, num_kv_blocks=NUM_BLOCKS, num_cpu_blocks=NUM_CPU_BLOCKS)
    assert r.tables.max_blocks_per_seq == MAX_BLOCKS_PER_SEQ
    seqs = [new_seq(10, random_prompt(1, 20), [0, 1]), new_seq(11, random_prompt(2, 5), [2])]
    _checked_execute(r, plan(0, {10: 20, 11: 5}, new_seqs=seqs))
    return r


def _state(runner: ModelRunner) -> tuple:
    """Everything a plan can change: each sequence's state, the block table rows, the steps in flight, the
    KV pools."""
    seqs = {
        seq_id: (
            list(s.token_ids),
            runner.sequences.block_table(seq_id),
            s.num_computed_tokens,
            s.pending,
            s.row,
            s.seed,
        )
        for seq_id, s in runner.sequences.seqs.items()
    }
    return (
        seqs,
        runner.tables.tables.copy().tobytes(),
        [step.step_id for step in runner.in_flight],
        _bytes(runner.kv.device_pool),
        _bytes(runner.kv.cpu_pool),
    )


def _bytes(pool: torch.Tensor) -> bytes:
    """The pool's bytes: unwritten blocks hold garbage, NaN among it, which compares unequal as floats."""
    return pool.contiguous().view(torch.uint8).numpy().tobytes()


def _assert_same_state(before: tuple, after: tuple) -> None:
    assert before == after


def test_valid_plans_pass_and_run(tiny_model_dir: Path) -> None:
    """Every part of a plan used correctly: a valid plan is never refused (a refusal makes the worker start
    over, failing every request)."""
    r = make_runner(tiny_model_dir, num_kv_blocks=NUM_BLOCKS, num_cpu_blocks=NUM_CPU_BLOCKS)
    _checked_execute(r, plan(0, {1: 18}, new_seqs=[new_seq(1, random_prompt(3, 18), [0, 1])]))
    # A fork from the prefill of a second prompt, a decode of the first, a copy-on-write of a block.
    _checked_execute(
        r,
        plan(
            1,
            {1: 1, 2: 4},
            new_seqs=[new_seq(2, random_prompt(4, 4), [3])],
            new_block_ids=[(1, [4])],
            forks=[Fork(2, 5, 9)],
        ),
    )
    _checked_execute(r, plan(2, {5: 1}, block_copies=[(3, 6)], new_block_tables=[(5, [6])]))
    # Swap sequence 1 out and back in to other blocks; a beam-style clone with a token the scheduler chose.
    _checked_execute(r, plan(3, swap_out=[(0, 0), (1, 1), (4, 2)]))
    _checked_execute(
        r,
        plan(
            4,
            {1: 1},
            swap_in=[(0, 7), (1, 8), (2, 9)],
            new_block_tables=[(1, [7, 8, 9])],
            clones=[(2, 12)],
            appended_tokens=[(12, 3)],
            freed_seq_ids=[2],
        ),
    )
    assert set(r.sequences.seqs) == {1, 5, 12}


def _bad_plans() -> list[tuple[str, StepPlan, str]]:
    """(what is wrong, the plan, a phrase of the reason) against the `runner` fixture's state."""
    too_long = MAX_BLOCKS_PER_SEQ + 1
    return [
        ("freed id unknown", plan(freed_seq_ids=[99]), "freed sequence 99 is unknown"),
        ("freed twice", plan(freed_seq_ids=[11, 11]), "freed sequence 11 is unknown"),
        ("new id present", plan(new_seqs=[new_seq(10, [1], [3])]), "already exists"),
        ("new id twice", plan(new_seqs=[new_seq(12, [1], [3]), new_seq(12, [1], [4])]), "already exists"),
        ("new seq block off pool", plan(new_seqs=[new_seq(12, [1], [NUM_BLOCKS])]), "outside the KV pool"),
        ("new seq negative block", plan(new_seqs=[new_seq(12, [1], [-1])]), "outside the KV pool"),
        ("new seq token off vocab", plan(new_seqs=[new_seq(12, [1, 10**6], [3])]), "outside the vocab"),
        ("new seq table too long", plan(new_seqs=[new_seq(12, [1], [3] * too_long)]), "past max_model_len"),
        ("computed past tokens", plan(new_seqs=[new_seq(12, [1], [3], num_computed_tokens=2)]), "computed"),
        (
            "logprobs past vocab",
            plan(
                new_seqs=[
                    msgspec.structs.replace(new_seq(12, [1], [3]), params=SamplingParams(logprobs=10**6))
                ]
            ),
            "logprobs",
        ),
        ("new blocks, unknown seq", plan(new_block_ids=[(99, [3])]), "unknown sequence 99"),
        ("new blocks off pool", plan(new_block_ids=[(10, [NUM_BLOCKS + 3])]), "outside the KV pool"),
        ("new table, unknown seq", plan(new_block_tables=[(99, [3])]), "unknown sequence 99"),
        ("new table off pool", plan(new_block_tables=[(10, [3, NUM_BLOCKS])]), "outside the KV pool"),
        ("swap_out to no CPU block", plan(swap_out=[(0, NUM_CPU_BLOCKS)]), "outside the pools"),
        ("swap_in from no CPU block", plan(swap_in=[(NUM_CPU_BLOCKS, 3)]), "outside the pools"),
        ("swap_in writes twice", plan(swap_in=[(0, 3), (1, 3)]), "writes a block twice"),
        ("copy off pool", plan(block_copies=[(0, NUM_BLOCKS)]), "outside the pools"),
        # KV tiers (the runner has a host tier, by default, and no disk tier)
        ("offload off pool", plan(tier_offloads=[(NUM_BLOCKS, 0)]), "outside the pools"),
        ("offload writes twice", plan(tier_offloads=[(0, 1), (2, 1)]), "tier_offloads writes a block twice"),
        ("load writes twice", plan(tier_loads=[(0, 3), (1, 3)]), "tier_loads writes a block twice"),
        ("load off pool", plan(tier_loads=[(0, NUM_BLOCKS)]), "outside the pools"),
        ("disk read, no disk tier", plan(disk_reads=[(0, 0)]), "disk_reads pair (0, 0) is outside"),
        ("disk write, no disk tier", plan(disk_writes=[(0, 0)]), "disk_writes pair (0, 0) is outside"),
        ("copy reads its write", plan(block_copies=[(3, 4), (4, 5)]), "also reads"),
        ("scheduled unknown", plan(100, {99: 1}), "scheduled sequence 99 is unknown"),
        ("scheduled freed", plan(100, {11: 1}, freed_seq_ids=[11]), "scheduled sequence 11 is unknown"),
        ("scheduled twice", StepPlan(100, [], [], [], [10, 10], [1, 1], []), "scheduled twice"),
        ("lengths differ", StepPlan(100, [], [], [], [10, 11], [1], []), "lengths differ"),
        ("sampling, not scheduled", plan(100, {10: 1}, sampling_seq_ids=[10, 11]), "11 is not scheduled"),
        (
            "sampling mid-prompt",
            plan(100, {12: 3}, new_seqs=[new_seq(12, random_prompt(5, 5), [3])]),
            "12 is not scheduled up to all its tokens",
        ),
        ("sampling twice", plan(100, {10: 1}, sampling_seq_ids=[10, 10]), "names a sequence twice"),
        ("sampling out of order", plan(100, {10: 1, 11: 1}, sampling_seq_ids=[11, 10]), "batch order"),
        ("zero tokens", plan(100, {10: 0}), "scheduled 0 tokens"),
        ("past known tokens", plan(100, {10: 2}), "knows 21"),
        ("table too short", plan(100, {12: 20}, new_seqs=[new_seq(12, random_prompt(5, 20), [3])]), "slots"),
        ("append off vocab", plan(appended_tokens=[(10, 10**6)]), "outside the vocab"),
        ("append to unknown", plan(appended_tokens=[(99, 1)]), "unknown sequence 99"),
        ("clone of unknown", plan(clones=[(99, 12)]), "clone parent 99 is unknown"),
        ("clone onto present", plan(clones=[(10, 11)]), "clone 11 already exists"),
        ("fork, parent not sampling", plan(forks=[Fork(10, 12, 1)]), "does not sample"),
        ("fork child present", plan(100, {10: 1}, forks=[Fork(10, 11, 1)]), "fork child 11 already exists"),
        ("fork child twice", plan(100, {10: 1}, forks=[Fork(10, 12, 1), Fork(10, 12, 2)]), "appears twice"),
        # Valid parts first: the runner's own checks would have applied them before failing.
        ("late problem", plan(100, {99: 1}, freed_seq_ids=[11], block_copies=[(0, 5)]), "99 is unknown"),
    ]


@pytest.mark.parametrize("what, bad, reason", _bad_plans(), ids=[case[0] for case in _bad_plans()])
def test_bad_plans_are_refused_before_any_state_changes(
    runner: ModelRunner, what: str, bad: StepPlan, reason: str
) -> None:
    """A plan that contradicts the worker's state used to fail half-applied (PlanError after its freed ids
    and copies were done), or past the runner's own checks (a table wider than its rows, logprobs past the
    vocab). check_plan names the problem and touches nothing."""
    before = _state(runner)
    problem = runner.check_plan(bad)
    assert problem is not None and reason in problem, (what, problem)
    assert problem.startswith("step 100: ")
    _assert_same_state(before, _state(runner))


def _launched(tiny_model_dir: Path) -> ModelRunner:
    """A runner whose sequence 10 (20 prompt tokens, one sampled) has a decode step in flight: 22 known
    tokens, the last one pending; sequence 11 has none in flight."""
    r = make_runner(tiny_model_dir, num_kv_blocks=NUM_BLOCKS, num_cpu_blocks=NUM_CPU_BLOCKS)
    seqs = [new_seq(10, random_prompt(1, 20), [0, 1]), new_seq(11, random_prompt(2, 5), [2])]
    _checked_execute(r, plan(0, {10: 20, 11: 5}, new_seqs=seqs))
    p = plan(1, {10: 1})
    assert r.check_plan(p) is None
    r.launch(p)
    assert r.sequences.seqs[10].pending == 1 and len(r.in_flight) == 1
    return r


@pytest.mark.parametrize(
    "bad, reason",
    [
        (plan(2, {10: 2}), "knows 22"),
        (plan(2, {10: 1}, forks=[Fork(10, 12, 1)]), "fork parent 10 has a sampled token in flight"),
        (plan(2, clones=[(10, 12)]), "clone parent 10 has a sampled token in flight"),
        (plan(2, appended_tokens=[(10, 5)]), "before its token in flight"),
    ],
    ids=["past-pending-token", "fork", "clone", "append"],
)
def test_a_token_in_flight_counts_as_known_and_cannot_be_copied(
    tiny_model_dir: Path, bad: StepPlan, reason: str
) -> None:
    """With async scheduling the plan after a decode step arrives before that step's token: the check must
    count the token (a valid next decode is not refused) and refuse copies that would lose it (a fork child
    or clone would count it as pending and never receive it)."""
    r = _launched(tiny_model_dir)
    before = _state(r)
    problem = r.check_plan(bad)
    assert problem is not None and reason in problem
    _assert_same_state(before, _state(r))
    nxt = plan(2, {10: 1, 11: 1})
    assert r.check_plan(nxt) is None
    r.launch(nxt)  # the pending token goes straight from step 1's sampler into step 2's input
    outputs = [r.finish(), r.finish()]
    assert [out.seq_ids for out in outputs] == [[10], [10, 11]]
    assert len(r.sequences.seqs[10].token_ids) == 23 and r.sequences.seqs[10].pending == 0
    # Once step 1 finished the token is in token_ids and the same counts hold.
    assert "knows 23" in r.check_plan(plan(3, {10: 2}))


def _run_fresh(runner: ModelRunner, run: Callable[[ModelRunner], None] | None = None) -> list[list[int]]:
    """Tokens of a greedy prefill and three decodes of one prompt, as sequence 10 in blocks [0, 1]."""
    out = _checked_execute(runner, plan(0, {10: 20}, new_seqs=[new_seq(10, random_prompt(7, 20), [0, 1])]))
    tokens = [out.token_ids]
    for step in range(1, 4):
        tokens.append(_checked_execute(runner, plan(step, {10: 1})).token_ids)
    return tokens


def test_reset_forgets_everything_and_serves_a_fresh_plan_like_a_new_runner(tiny_model_dir: Path) -> None:
    """On re-announce to a new scheduler, the worker must hold nothing of the old one: the new scheduler
    reuses seq ids and block ids from 0, and its first plans must run as on a new worker."""
    fresh = _run_fresh(make_runner(tiny_model_dir, num_kv_blocks=NUM_BLOCKS, num_cpu_blocks=NUM_CPU_BLOCKS))
    r = _launched(tiny_model_dir)  # a step in flight, sequences 10 and 11 known, blocks 0-2 written
    r.reset()
    assert not r.sequences.seqs and not r.in_flight
    assert "unknown" in r.check_plan(plan(5, {11: 1}))
    assert _run_fresh(r) == fresh
