"""Speculative decoding with the n-gram proposer through the real scheduler core and the real model runner
(one process, float32, the tiny checkpoint): outputs identical to those without speculation, greedy and
seeded sampling, under preemption (recompute and swap) with a tiny pool, with prefix caching and n > 1, and
the block manager's invariants after every step."""

from __future__ import annotations

import json
import random

import pytest

from pagedserve.common.config import WorkerConfig
from pagedserve.common.messages import SamplingParams
from pagedserve.worker.model_runner import ModelRunner
from tests import engine_loop

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})


def make_runner(model_dir, num_kv_blocks: int, speculative: str = "", block_size: int = 4) -> ModelRunner:
    config = WorkerConfig(
        model=str(model_dir), device="cpu", dtype="float32", block_size=block_size,
        num_kv_blocks=num_kv_blocks, swap_space=0.05, speculative_config=speculative,
    )  # fmt: skip
    return ModelRunner(config)


def run_engine(runner: ModelRunner, prompts: list[list[int]], params, pipelined: bool, **kw):
    """Runs the prompts to the end as the server does (tests/engine_loop.py, scheduler/server.py
    `_run_steps`): with `pipelined`, plan N+1 is made and launched before step N's tokens are in, except
    when the next plan would draft. Returns {(prompt, sample): tokens}, the scheduler and the number of
    steps."""
    each = params if isinstance(params, list) else [params] * len(prompts)  # one for all, or one per prompt
    run = engine_loop.run_engine(
        runner, list(zip(prompts, each, strict=True)), pipelined, num_cpu_blocks=runner.num_cpu_blocks,
        num_speculative_tokens=runner.num_speculative_tokens,
        **{"max_num_seqs": 8, "max_num_batched_tokens": 48, **kw},
    )  # fmt: skip
    return run.tokens, run.scheduler, run.steps


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    out = [[rng.randrange(vocab) for _ in range(n)] for n in (1, 3, 7, 16, 17, 29, 40)]
    # repetitive prompts, where prompt lookup finds drafts; a shared prefix for the prefix cache
    motif = [rng.randrange(vocab) for _ in range(5)]
    return out + [motif * 6, motif * 4 + [1, 2], list(out[6]), out[5] + out[2]]


CASES = [  # (name, pool, policies, pipelined)
    ("roomy", 400, dict(preemption_mode="recompute"), False),
    ("roomy", 400, dict(preemption_mode="recompute"), True),
    ("recompute", 40, dict(preemption_mode="recompute"), True),
    ("recompute-no-prefix-cache", 40, dict(preemption_mode="recompute", enable_prefix_caching=False), False),
    ("swap", 40, dict(preemption_mode="swap"), True),
]


@pytest.fixture(scope="module")
def baseline(tiny_model_dir):
    """Greedy outputs without speculation (the engine's, which test_engine_correctness holds to
    transformers' generate)."""
    runner = make_runner(tiny_model_dir, 400)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    out, _, steps = run_engine(runner, prompts(runner.vocab_size), params, pipelined=False)
    return out, steps


@pytest.mark.parametrize(
    "name,num_kv_blocks,policies,pipelined",
    CASES,
    ids=[f"{c[0]}-{'pipelined' if c[3] else 'sync'}" for c in CASES],
)
def test_greedy_with_ngram_speculation_matches_without(
    tiny_model_dir, baseline, name, num_kv_blocks, policies, pipelined
):
    expected, _ = baseline
    runner = make_runner(tiny_model_dir, num_kv_blocks, NGRAM)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ours, scheduler, steps = run_engine(runner, prompts(runner.vocab_size), params, pipelined, **policies)
    assert ours == expected
    m = scheduler.metrics
    assert m.spec_draft_tokens_total > 0 and m.spec_accepted_tokens_total > 0
    assert m.spec_accepted_tokens_total <= m.spec_draft_tokens_total
    assert m.spec_acceptance_length.count > 0
    if name != "roomy":
        assert m.preemptions_total >= 1
    if name == "swap":
        assert m.swap_outs_total >= 1
    if policies.get("enable_prefix_caching", True):
        assert m.prefix_cache_hits_total > 0
    text = scheduler.metrics_text()
    assert "pagedserve_spec_draft_tokens_total" in text and "pagedserve_spec_acceptance_length_bucket" in text


def test_seeded_sampling_with_speculation_is_the_same_draws(tiny_model_dir):
    """Every emitted token is the draw of its position (seed, position), so seeded sampling with n > 1, top-p,
    top-k and min_p gives the same tokens with and without speculation, under preemption too."""
    rng = random.Random(1)
    motif = [rng.randrange(500) for _ in range(4)]
    ps = [[rng.randrange(1000) for _ in range(n)] for n in (5, 12)] + [motif * 5]
    params = SamplingParams(n=3, max_tokens=16, temperature=0.5, top_p=0.95, top_k=4, min_p=0.05, seed=1234)
    plain, _, _ = run_engine(make_runner(tiny_model_dir, 64), ps, params, False, max_num_seqs=16)
    runner = make_runner(tiny_model_dir, 12, NGRAM)
    spec, scheduler, _ = run_engine(runner, ps, params, True, max_num_seqs=16)
    assert spec == plain
    assert scheduler.metrics.spec_draft_tokens_total > 0
    assert scheduler.metrics.preemptions_total > 0


def test_stop_token_inside_an_accepted_run_ends_there(tiny_model_dir, baseline):
    """A stop token among the accepted tokens ends the sequence; the tokens after it are dropped, and
    max_tokens is respected inside a run."""
    expected, _ = baseline
    runner = make_runner(tiny_model_dir, 400, NGRAM)
    ps = prompts(runner.vocab_size)
    i = len(ps) - 4  # the motif prompt: drafts accepted
    full = expected[(i, 0)]
    stop = full[10]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(stop,))
    ours, _, _ = run_engine(runner, [ps[i]], params, pipelined=False)
    assert ours[(0, 0)] == full[: full.index(stop) + 1]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    _, _, plain_steps = run_engine(make_runner(tiny_model_dir, 400), [ps[i]], params, pipelined=False)
    ours, _, steps = run_engine(make_runner(tiny_model_dir, 400, NGRAM), [ps[i]], params, pipelined=False)
    assert ours[(0, 0)] == full
    assert steps < plain_steps  # accepted drafts save steps
    params = SamplingParams(max_tokens=7, temperature=0.0)
    ours, _, _ = run_engine(make_runner(tiny_model_dir, 400, NGRAM), [ps[i]], params, pipelined=False)
    assert ours[(0, 0)] == full[:7]


def test_speculation_backs_off_past_the_draft_budget(tiny_model_dir, baseline):
    """A draft budget smaller than the batch: no drafts at all, the same outputs, pipelined as without."""
    expected, _ = baseline
    runner = make_runner(tiny_model_dir, 400, NGRAM)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ours, scheduler, _ = run_engine(
        runner, prompts(runner.vocab_size), params, True, speculative_draft_budget=0
    )
    assert ours == expected
    assert scheduler.metrics.spec_draft_tokens_total == 0
    assert runner.num_tokens_fed > 0  # pipelined: tokens read on the device


def test_bad_draft_slots_are_refused_by_the_worker(tiny_model_dir):
    """Draft slots the worker cannot honour are a scheduler bug: PlanError, as for any bad plan."""
    from pagedserve.common.messages import NewSequence, StepPlan
    from pagedserve.worker.plan_check import PlanError

    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = [5, 6, 7, 5, 6]

    def plan(draft_slots, blocks=(0, 1)):
        new = NewSequence(1, prompt, list(blocks), 0, params, 0)
        return StepPlan(0, [], [new], [], [1], [len(prompt)], [1], draft_slots=draft_slots)

    plain = make_runner(tiny_model_dir, 16)
    assert "without --speculative-config" in plain.check_plan(plan([(1, 2)]))  # refused whole, before it runs
    with pytest.raises(PlanError, match="without --speculative-config"):
        plain.execute(plan([(1, 2)]))
    runner = make_runner(tiny_model_dir, 16, NGRAM)
    assert "does not decode one token" in runner.check_plan(plan([(1, 2)]))
    assert "twice" in runner.check_plan(plan([(1, 2), (1, 1)]))
    with pytest.raises(PlanError, match="does not decode one token"):
        runner.execute(plan([(1, 2)]))  # a 5-token prefill chunk cannot draft
    runner = make_runner(tiny_model_dir, 16, NGRAM)
    first = StepPlan(0, [], [NewSequence(1, prompt, [0, 1], 0, params, 0)], [], [1], [4], [])
    assert runner.execute(first).seq_ids == []
    with pytest.raises(PlanError, match="blocks or length"):  # 4 computed + 1 + 4 > 2 blocks of 4
        runner.execute(StepPlan(1, [], [], [], [1], [1], [1], draft_slots=[(1, 4)]))


def test_no_plan_is_launched_behind_a_step_that_verifies_drafts(tiny_model_dir):
    """The drafts a step accepts move its sequences' next positions: a plan launched behind it would compute
    from the old ones (a tensor-parallel follower did, docs/speculative.md). The scheduler never plans
    then; the runner refuses such a launch instead of computing wrong tokens, and runs the plan once the
    step is finished."""
    from pagedserve.common.messages import NewSequence, StepPlan

    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompt = [5, 6, 7, 5, 6]  # prompt lookup drafts 7, 5, 6, ...
    runner = make_runner(tiny_model_dir, 16, NGRAM)
    new = NewSequence(1, prompt, [0, 1, 2], 0, params, 0)
    assert runner.execute(StepPlan(0, [], [new], [], [1], [4], [])).seq_ids == []
    runner.launch(StepPlan(1, [], [], [], [1], [1], [1], draft_slots=[(1, 4)]))
    following = StepPlan(2, [], [], [], [1], [1], [1])
    with pytest.raises(RuntimeError, match="behind a step that verifies drafts"):
        runner.launch(following)
    out = runner.finish()
    assert out.num_drafts[0] > 0
    runner.launch(following)  # its position follows the accepted drafts now
    assert runner.finish().seq_ids == [1]
    assert runner.sequences.seqs[1].num_computed_tokens == len(prompt) + out.num_tokens[0]


class OracleProposer:
    """Drafts the known greedy continuation, wrong at every `wrong_every`-th draft position: long accepted
    runs (bonus tokens after k accepted drafts) and rejections at known places."""

    def __init__(self, answers: dict[tuple[int, ...], list[int]], wrong_every: int, vocab: int) -> None:
        self.answers = answers
        self.wrong_every = wrong_every
        self.vocab = vocab

    def propose(self, rows):
        out = []
        for row in rows:
            tokens = list(row.token_ids)
            drafts = []
            for prompt, full in self.answers.items():
                if (
                    tokens[: len(prompt)] == list(prompt)
                    and tokens[len(prompt) :] == full[: len(tokens) - len(prompt)]
                ):
                    drafts = full[len(tokens) - len(prompt) : len(tokens) - len(prompt) + row.num_tokens]
                    break
            out.append(
                [
                    (t + 1) % self.vocab if (len(tokens) + j) % self.wrong_every == 0 else t
                    for j, t in enumerate(drafts)
                ]
            )
        return out

    def free(self, seq_id):
        pass


@pytest.mark.parametrize("wrong_every,num_kv_blocks,pipelined", [(1000, 400, False), (3, 40, True)])
def test_long_accepted_runs_with_an_oracle_proposer(
    tiny_model_dir, baseline, wrong_every, num_kv_blocks, pipelined
):
    """With drafts that are mostly right, runs of up to k + 1 tokens per step (a bonus token after k accepted
    drafts), still identical outputs, blocks released under preemption."""
    expected, _ = baseline
    runner = make_runner(tiny_model_dir, num_kv_blocks, NGRAM)
    ps = prompts(runner.vocab_size)
    answers = {tuple(p): expected[(i, 0)] for i, p in enumerate(ps)}
    runner.spec.proposer = OracleProposer(answers, wrong_every, runner.vocab_size)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ours, scheduler, _ = run_engine(runner, ps, params, pipelined, preemption_mode="recompute")
    assert ours == expected
    hist = scheduler.metrics.spec_acceptance_length
    if wrong_every == 1000:
        assert hist.counts[4] > 0  # k = 4 accepted drafts and a bonus token in one step
    else:
        assert hist.counts[2] > 0 and hist.counts[0] > 0  # two right, then one wrong
        assert scheduler.metrics.preemptions_total > 0
        assert scheduler.metrics.spec_accepted_tokens_total < scheduler.metrics.spec_draft_tokens_total


def test_structured_and_penalized_sequences_decode_beside_drafting_ones(tiny_model_dir, baseline):
    """A constrained sequence and a penalized one in the batch draft nothing; their rows (and the bitmask)
    sit between the drafting sequences' rows; every output is as without speculation."""
    from pagedserve.common.sampling_params import StructuredOutput

    expected, _ = baseline
    runner = make_runner(tiny_model_dir, 400, NGRAM)
    ps = prompts(runner.vocab_size)
    greedy = SamplingParams(max_tokens=24, temperature=0.0)
    constrained = SamplingParams(
        max_tokens=24, temperature=0.0, structured=StructuredOutput("regex", "[a-f]{3,8}")
    )
    penalized = SamplingParams(max_tokens=24, temperature=0.0, presence_penalty=1.0)
    params = [greedy] * len(ps)
    params[1], params[3] = constrained, penalized
    ours, scheduler, _ = run_engine(runner, ps, params, pipelined=False)
    plain, _, _ = run_engine(make_runner(tiny_model_dir, 400), ps, params, pipelined=False)
    assert ours == plain
    assert all(ours[(i, 0)] == expected[(i, 0)] for i in range(len(ps)) if i not in (1, 3))
    assert ours[(1, 0)] != expected[(1, 0)]  # the constraint took effect
    assert scheduler.metrics.spec_accepted_tokens_total > 0


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    from scripts.make_model import make_model

    return make_model(tmp_path_factory.mktemp("draft") / "tiny-draft", preset="tiny-draft", seed=1)


DRAFT_CASES = [c for c in CASES if c[0] in ("roomy", "recompute", "swap")]


@pytest.mark.parametrize(
    "name,num_kv_blocks,policies,pipelined",
    DRAFT_CASES,
    ids=[f"{c[0]}-{'pipelined' if c[3] else 'sync'}" for c in DRAFT_CASES],
)
def test_greedy_with_a_draft_model_matches_without(
    tiny_model_dir, draft_dir, baseline, name, num_kv_blocks, policies, pipelined
):
    """The draft-model proposer (worker/spec/draft_model.py, its own pool sized with the target's) through
    the engine: a different random model, so most drafts are rejected and its KV rolled back; the outputs
    stay the target's, under preemption and swap too, and every block of both pools returns."""
    expected, _ = baseline
    spec = json.dumps({"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3})
    runner = make_runner(tiny_model_dir, num_kv_blocks, spec)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ours, scheduler, _ = run_engine(runner, prompts(runner.vocab_size), params, pipelined, **policies)
    assert ours == expected
    m = scheduler.metrics
    assert m.spec_draft_tokens_total > 0
    if name != "roomy":
        assert m.preemptions_total >= 1
    if name == "swap":
        assert m.swap_outs_total >= 1
    pool = runner.spec.proposer.pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks and not pool.seqs  # finished sequences freed theirs


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_model_dir, baseline):
    """With the target itself as the draft, every greedy draft is the target's own next token: all are
    accepted, and a step emits up to k + 1 tokens (fewer steps than without)."""
    expected, plain_steps = baseline
    spec = json.dumps({"method": "draft_model", "model": str(tiny_model_dir), "num_speculative_tokens": 4})
    runner = make_runner(tiny_model_dir, 400, spec)
    params = SamplingParams(max_tokens=24, temperature=0.0)
    ours, scheduler, steps = run_engine(runner, prompts(runner.vocab_size), params, pipelined=False)
    assert ours == expected
    m = scheduler.metrics
    assert m.spec_accepted_tokens_total == m.spec_draft_tokens_total > 0
    assert steps < plain_steps
