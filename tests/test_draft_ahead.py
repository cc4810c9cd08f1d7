"""Drafting ahead (worker/spec/ahead.py): the draft model drafts a drafting step's next drafts right after
the worker answers it, and the next plan takes them where they fit.

Through the real scheduler core and runner (tests/engine_loop.py, which drafts ahead as the worker loop
does): greedy outputs identical to those without speculation (under preemption, swap, n > 1 with seeded
sampling), the drafts made ahead actually used, the same drafts verified as without drafting ahead, both
block pools whole. With hand-made plans whose rows differ from those drafted ahead (a sequence freed, a
larger k, a smaller k, another order, one recomputed), every row's drafts are the draft checkpoint's own
greedy continuation from transformers (`generate`)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve.common.messages import NewSequence, SamplingParams, StepPlan
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.worker.model_runner import ModelRunner
from scripts.make_model import make_model
from tests import engine_loop
from tests.test_draft_model import Reference
from tests.test_speculative_engine import CASES, make_runner, prompts, run_engine

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_model(tmp_path_factory.mktemp("draft") / "tiny-draft", preset="tiny-draft", seed=1)


@pytest.fixture(scope="module")
def baseline(tiny_model_dir: Path) -> dict:
    """Greedy outputs without speculation."""
    runner = make_runner(tiny_model_dir, 400)
    out, _, _ = run_engine(runner, prompts(runner.vocab_size), GREEDY, pipelined=False)
    return out


def _spec(model: Path, k: int = 4) -> str:
    return json.dumps({"method": "draft_model", "model": str(model), "num_speculative_tokens": k})


def _check_pool(_scheduler: Scheduler, runner: ModelRunner) -> None:
    runner.spec.proposer.pool.check_invariants()


def _flush_frees(scheduler: Scheduler, runner: ModelRunner) -> None:
    """The frees the scheduler holds for its next plan that runs (none comes once the requests are done),
    sent in a plan that only frees; then neither the worker nor the draft's pool holds anything."""
    freed = scheduler._freed_seq_ids
    if freed:
        runner.execute(StepPlan(1 << 20, list(freed), [], [], [], [], []))
    pool = runner.spec.proposer.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks and not pool.seqs
    assert not runner.sequences.seqs and not runner.spec._known


def _run(runner: ModelRunner, ps, params, pipelined: bool, draft_ahead: bool = True, **kw):
    run = engine_loop.run_engine(
        runner, list(zip(ps, params if isinstance(params, list) else [params] * len(ps), strict=True)),
        pipelined, num_cpu_blocks=runner.num_cpu_blocks, num_speculative_tokens=runner.num_speculative_tokens,
        after_step=_check_pool, draft_ahead=draft_ahead,
        **{"max_num_seqs": 8, "max_num_batched_tokens": 48, **kw},
    )  # fmt: skip
    _flush_frees(run.scheduler, runner)
    return run


@pytest.mark.parametrize(
    "name,num_kv_blocks,policies,pipelined",
    [c for c in CASES if c[0] in ("roomy", "recompute", "swap")],
    ids=lambda c: c if isinstance(c, str) else None,
)
def test_drafts_made_ahead_are_used_and_verify_as_the_plan_would_propose(
    tiny_model_dir: Path, baseline: dict, name: str, num_kv_blocks: int, policies: dict, pipelined: bool
) -> None:
    """The target as its own draft: every draft accepted whoever made it. Drafting ahead, most rows take
    the drafts made ahead; the outputs are the target's, and the steps, the drafts verified and accepted
    are exactly those of the same run proposing every draft at the plan."""
    runs = {}
    for ahead in (True, False):
        runner = make_runner(tiny_model_dir, num_kv_blocks, _spec(tiny_model_dir))
        ps = prompts(runner.vocab_size)
        run = _run(runner, ps, GREEDY, pipelined, draft_ahead=ahead, **policies)
        assert run.tokens == baseline
        m = run.scheduler.metrics
        assert m.spec_accepted_tokens_total == m.spec_draft_tokens_total > 0
        if name != "roomy":
            assert m.preemptions_total >= 1
        if name == "swap":
            assert m.swap_outs_total >= 1
        runs[ahead] = (run.steps, m.spec_draft_tokens_total, runner.spec.ahead)
    (steps, drafts, ahead), (plain_steps, plain_drafts, not_ahead) = runs[True], runs[False]
    assert (steps, drafts) == (plain_steps, plain_drafts)
    assert not_ahead.num_calls == not_ahead.num_rows_taken == 0
    assert ahead.num_calls > 0 and ahead.num_rows_taken > 0
    if name == "roomy":  # (with a tiny pool the plans often leave out or preempt what was drafted ahead)
        assert ahead.num_rows_taken > ahead.num_rows_proposed


@pytest.mark.parametrize("num_kv_blocks,pipelined", [(400, False), (40, True)])
def test_a_draft_that_disagrees_keeps_the_outputs_with_drafts_made_ahead(
    tiny_model_dir: Path, draft_dir: Path, baseline: dict, num_kv_blocks: int, pipelined: bool
) -> None:
    """Another random model as the draft: most drafts made ahead are rejected and the draft's KV rolls back
    at the next call; outputs as without speculation, under preemption too."""
    runner = make_runner(tiny_model_dir, num_kv_blocks, _spec(draft_dir, 3))
    kw = dict(preemption_mode="recompute", speculative_min_accepted=0.0)  # never pause: draft every step
    run = _run(runner, prompts(runner.vocab_size), GREEDY, pipelined, **kw)
    assert run.tokens == baseline
    m = run.scheduler.metrics
    assert m.spec_draft_tokens_total > m.spec_accepted_tokens_total
    assert runner.spec.ahead.num_rows_taken > 0
    if num_kv_blocks == 40:
        assert m.preemptions_total >= 1


def test_seeded_sampling_with_n_samples_is_the_same_draws_drafting_ahead(tiny_model_dir: Path) -> None:
    """n = 3 forks (a fork parent drafts nothing in the step it forks), top-p, top-k, min_p, a tiny pool:
    the tokens with drafts made ahead are the draws of sampling without speculation."""
    rng = random.Random(1)
    motif = [rng.randrange(500) for _ in range(4)]
    ps = [[rng.randrange(1000) for _ in range(n)] for n in (5, 12)] + [motif * 5]
    params = SamplingParams(n=3, max_tokens=16, temperature=0.5, top_p=0.95, top_k=4, min_p=0.05, seed=1234)
    plain, _, _ = run_engine(make_runner(tiny_model_dir, 64), ps, params, False, max_num_seqs=16)
    runner = make_runner(tiny_model_dir, 16, _spec(tiny_model_dir))
    run = _run(runner, ps, params, True, max_num_seqs=16, speculative_min_accepted=0.0)
    assert run.tokens == plain
    assert run.scheduler.metrics.spec_accepted_tokens_total > 0
    assert run.scheduler.metrics.preemptions_total > 0
    assert runner.spec.ahead.num_rows_taken > 0


def test_the_ngram_proposer_never_drafts_ahead(tiny_model_dir: Path, baseline: dict) -> None:
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    runner = make_runner(tiny_model_dir, 400, ngram)
    out, scheduler, _ = run_engine(runner, prompts(runner.vocab_size), GREEDY, pipelined=False)
    assert out == baseline and scheduler.metrics.spec_draft_tokens_total > 0
    assert runner.spec.ahead.num_calls == 0 and runner.spec.ahead.num_rows_taken == 0


# -----------------------------------------------------------------------------------------------------------
# Hand-made plans


class _Plans:
    """Plans for a runner whose sequences each hold 8 blocks of its pool (room for every step here)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.step = 0
        self.tables: dict[int, list[int]] = {}

    def run(self, plan: StepPlan):
        """Runs the plan; returns the drafts each sampler verified and the tokens it had at the plan."""
        seqs = self.runner.sequences.seqs
        before = {seq_id: list(seqs[seq_id].token_ids) for seq_id in plan.scheduled_seq_ids if seq_id in seqs}
        for new in plan.new_seqs:
            before[new.seq_id] = list(new.token_ids)
        assert self.runner.check_plan(plan) is None, self.runner.check_plan(plan)
        self.runner.launch(plan)
        step = self.runner.in_flight[-1]
        self.runner.finish()
        self.step += 1
        drafts = dict(zip(step.seq_ids, step.spec.drafts, strict=False)) if step.spec else {}
        return drafts, before

    def prefill(self, prompts: dict[int, list[int]]) -> None:
        new = []
        for seq_id, prompt in prompts.items():
            self.tables[seq_id] = list(range(8 * (seq_id - 1), 8 * seq_id))
            new.append(NewSequence(seq_id, prompt, self.tables[seq_id], 0, GREEDY_LONG, seq_id))
        ids = list(prompts)
        self.run(StepPlan(self.step, [], new, [], ids, [len(p) for p in prompts.values()], ids))

    def decode(
        self, slots: list[tuple[int, int]], freed: list[int] = (), new: list[NewSequence] = (), drafts=True
    ):
        """Each sequence of `slots` decodes with k draft slots (none without `drafts`): the blocks of its
        range that a drafting step released come back as far as its 1 + k slots need."""
        ids = [seq_id for seq_id, _ in slots]
        grown = []
        for seq_id, k in slots:
            seq = self.runner.sequences.seqs.get(seq_id)
            if seq is not None and seq_id not in freed:
                have = int(self.runner.tables.num_blocks[seq.row])
                need = -(-(seq.num_computed_tokens + 1 + k) // self.runner.block_size)
                grown += [(seq_id, self.tables[seq_id][have:need])] if need > have else []
        plan = StepPlan(
            self.step,
            list(freed),
            list(new),
            grown,
            ids,
            [1] * len(ids),
            ids,
            draft_slots=list(slots) if drafts else [],
        )
        return self.run(plan)


GREEDY_LONG = SamplingParams(max_tokens=64, temperature=0.0)


def test_a_plan_whose_rows_differ_gets_each_rows_own_drafts(tiny_model_dir: Path, draft_dir: Path) -> None:
    """Drafted ahead for 1, 2, 3, 4 (k 4, 2, 4, 4); the plan frees 4, asks 3 for 4 (taken), 1 for 2 (taken,
    cut), 2 for 4 (more than drafted ahead: proposed at the plan), in another order. Then 1 comes back as a
    new sequence (preempted, recomputed from the prefix cache): proposed at the plan, the others taken.
    Every row's drafts are the draft checkpoint's greedy continuation of its tokens."""
    rows_differ_scenario(make_runner(tiny_model_dir, 64, _spec(draft_dir)), Reference(draft_dir).greedy)


def rows_differ_scenario(runner: ModelRunner, greedy: Callable[[list[int], int], list[int]]) -> None:
    """The plans of `test_a_plan_whose_rows_differ_gets_each_rows_own_drafts` on `runner` (64 blocks, a
    draft model with k = 4); `greedy(tokens, n)`: the draft's n greedy tokens after `tokens`."""
    ahead, pool = runner.spec.ahead, runner.spec.proposer.pool
    rng = random.Random(3)
    plans = _Plans(runner)
    plans.prefill(
        {i: [rng.randrange(runner.vocab_size) for _ in range(n)] for i, n in enumerate((6, 9, 5, 7), 1)}
    )

    def check(drafts: dict[int, list[int]], before: dict[int, list[int]], ks: dict[int, int]) -> None:
        assert set(drafts) == set(ks)
        for seq_id, k in ks.items():
            assert drafts[seq_id] == greedy(before[seq_id], k), seq_id

    ks = {1: 4, 2: 2, 3: 4, 4: 4}
    check(*plans.decode(list(ks.items())), ks)
    assert (ahead.num_calls, ahead.num_rows_taken, ahead.num_rows_proposed) == (0, 0, 4)
    runner.draft_ahead()
    assert ahead.num_calls == 1 and set(ahead._rows) == {1, 2, 3, 4}

    ks = {3: 4, 1: 2, 2: 4}
    check(*plans.decode(list(ks.items()), freed=[4]), ks)
    assert (ahead.num_rows_taken, ahead.num_rows_proposed) == (2, 5)
    assert ahead.stats["ahead_rows"] == 2 and ahead.stats["plan_rows"] == 1 and ahead.stats["ahead_ms"] > 0
    assert 4 not in pool.seqs
    pool.check_invariants()

    runner.draft_ahead()
    tokens = list(runner.sequences.seqs[1].token_ids)
    back = NewSequence(1, tokens, plans.tables[1], len(tokens) - 1, GREEDY_LONG, 1, len(tokens) - 6)
    ks = {1: 3, 2: 3, 3: 4}
    check(*plans.decode(list(ks.items()), freed=[1], new=[back]), ks)
    assert (ahead.num_rows_taken, ahead.num_rows_proposed) == (4, 6)
    pool.check_invariants()

    # Drafted ahead, then a plan without drafts: dropped, nothing taken later from them.
    runner.draft_ahead()
    assert ahead.num_calls == 3
    plans.decode([(2, 0), (3, 0)], drafts=False)
    assert not ahead._rows
    for seq_id in (2, 3):  # the blocks that only the dropped drafts held went back to the draft's pool
        seq = pool.seqs[seq_id]
        assert len(seq.computed) == seq.num_truth
        assert len(seq.block_ids) == -(-seq.num_truth // pool.block_size)
    ks = {2: 2, 3: 2}
    check(*plans.decode(list(ks.items())), ks)
    assert (ahead.num_rows_taken, ahead.num_rows_proposed) == (4, 8)

    # A plan that only frees: the proposer frees them too.
    plans.run(StepPlan(plans.step, [1, 2, 3], [], [], [], [], []))
    assert not pool.seqs and pool.num_free_blocks == pool.num_blocks


def test_no_drafting_ahead_under_tensor_parallelism_nor_with_a_step_in_flight(
    tiny_model_dir: Path, draft_dir: Path
) -> None:
    """A follower cannot tell whether rank 0 drafted ahead: with more than one rank nobody does. Nor with a
    step in flight (its tokens are not on the host)."""
    runner = make_runner(tiny_model_dir, 64, _spec(draft_dir))
    plans = _Plans(runner)
    plans.prefill({1: [5, 6, 7, 8, 9]})
    plans.decode([(1, 4)])
    runner.parallel.world_size = 2  # (only what draft_ahead reads: no group is made)
    try:
        runner.draft_ahead()
    finally:
        runner.parallel.world_size = 1
    assert runner.spec.ahead.num_calls == 0
    runner.launch(StepPlan(plans.step, [], [], [], [1], [1], [1]))
    runner.draft_ahead()
    assert runner.spec.ahead.num_calls == 0
    runner.finish()
