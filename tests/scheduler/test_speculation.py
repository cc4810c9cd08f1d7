"""The scheduler's side of speculative decoding (scheduler/speculation.py) with the fake worker: the policy,
draft slots, accepted runs, outputs checked, blocks released."""

from __future__ import annotations

from pagedserve.common.messages import StepOutput
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.speculation import Speculation
from tests.scheduler.conftest import make_harness


def _drafting_step(h):
    """Steps until a plan has draft slots; returns that plan (its output not applied yet)."""
    for _ in range(50):
        plan = h.scheduler.schedule()
        if plan.draft_slots:
            return plan
        h.record(h.scheduler.update(h.worker.execute(plan)))
    raise AssertionError("no plan drafted")


def test_draft_slots_are_budgeted_and_allocated_and_released():
    h = make_harness(num_blocks=64, block_size=4, num_speculative_tokens=4, max_num_batched_tokens=64)
    h.submit("r", list(range(1, 10)), max_tokens=40, seed=3)
    plan = _drafting_step(h)
    ((seq_id, k),) = plan.draft_slots
    assert k == 4
    seq = h.scheduler._seqs[seq_id]
    manager = h.scheduler.block_manager
    # slots for the next token and the 4 drafts
    assert len(manager.block_table(seq_id)) * 4 >= seq.num_computed_tokens + k
    h.record(h.scheduler.update(h.worker.execute(plan)))
    h.scheduler.check_invariants()
    # after the update the table holds exactly the computed tokens' blocks, as the worker's does
    assert manager.block_table(seq_id) == h.worker.seqs[seq_id].block_table
    assert len(manager.block_table(seq_id)) == -(-seq.num_computed_tokens // 4)
    h.run()
    assert len(h.tokens[("r", 0)]) == 40
    assert manager.num_free_blocks == 64


def test_a_draft_budget_smaller_than_the_batch_drafts_nothing_and_max_tokens_bounds_k():
    h = make_harness(num_blocks=256, num_speculative_tokens=4, speculative_draft_budget=4)
    for i in range(5):
        h.submit(f"r{i}", [1, 2, 3, i], max_tokens=8)
    h.run()
    assert not any(p.draft_slots for p in h.worker.plans)  # 5 running, budget 4: 0 each
    h = make_harness(num_blocks=256, num_speculative_tokens=4, speculative_draft_budget=8)
    for i in range(3):
        h.submit(f"r{i}", [1, 2, 3, i], max_tokens=3)
    h.run()
    ks = [k for p in h.worker.plans for _, k in p.draft_slots]
    assert ks and max(ks) <= 2  # budget 8 // 3 running = 2; and never past max_tokens
    assert all(len(h.tokens[(f"r{i}", 0)]) == 3 for i in range(3))


def test_ineligible_sequences_never_draft():
    h = make_harness(num_blocks=256, num_speculative_tokens=3)
    h.submit("pen", [1, 2, 3], max_tokens=6, presence_penalty=0.5)
    h.submit("beam", [4, 5, 6], max_tokens=4, beam_width=2, n=2)
    h.run()
    assert not any(p.draft_slots for p in h.worker.plans)
    assert not h.scheduler.speculating


def test_low_acceptance_pauses_speculation_and_probes():
    from pagedserve.scheduler.settings import SchedulerSettings

    settings = SchedulerSettings(
        num_kv_blocks=8, block_size=4, max_model_len=64, vocab_size=10, eos_token_ids=(), max_num_seqs=4,
        max_num_batched_tokens=64, num_speculative_tokens=3, speculative_min_accepted=0.5,
        speculative_probe_steps=4,
    )  # fmt: skip
    spec = Speculation(settings, block_manager=None, metrics=SchedulerMetrics())  # type: ignore[arg-type]
    assert spec.step_k(1) == 3 and spec.step_k(16) == 3 and spec.step_k(40) == 1 and spec.step_k(65) == 0
    for step_id in range(30):  # nothing accepted
        spec.planned(step_id, [(1, 3)])
        list(spec.runs(StepOutput(step_id, [1], [7], [None], num_tokens=[1], num_drafts=[3])))
    assert spec.accepted_average < 0.5
    ks = []
    for step_id in range(30, 42):
        k = spec.step_k(1)
        ks.append(k)
        spec.planned(step_id, [(1, k)] if k else [])
        spec._in_flight.pop(step_id, None)
    assert ks.count(0) >= 8 and 0 < ks.count(3) <= 3  # paused, one probe in 4 steps


def test_malformed_speculative_outputs_are_refused():
    h = make_harness(num_blocks=64, num_speculative_tokens=3)
    h.submit("r", list(range(1, 10)), max_tokens=20)
    plan = _drafting_step(h)
    good = h.worker.execute(plan)
    (seq_id,) = plan.sampling_seq_ids
    check = h.scheduler.check_output
    assert check(good) is None
    bad = [
        StepOutput(
            plan.step_id, [seq_id], [1, 2], [None, None], num_tokens=[2], num_drafts=[0]
        ),  # > 1 + drafts
        StepOutput(
            plan.step_id, [seq_id], [1, 2], [None, None], num_tokens=[3], num_drafts=[3]
        ),  # sum differs
        StepOutput(plan.step_id, [seq_id], [1], [None], num_tokens=[1, 1], num_drafts=[0, 0]),  # lengths
        StepOutput(plan.step_id, [seq_id], [1, 5000], [None, None], num_tokens=[2], num_drafts=[2]),  # vocab
        StepOutput(plan.step_id, [seq_id], [1], [None], num_tokens=[0], num_drafts=[0]),
        StepOutput(plan.step_id, [seq_id], [1] * 18, [None] * 18, num_tokens=[18], num_drafts=[17]),
    ]
    for out in bad:
        assert check(out) is not None, out
    h.record(h.scheduler.update(good))
    h.run()
    assert h.scheduler.block_manager.num_free_blocks == 64
