"""One request's fault ends that request with an error, never the scheduler; a worker's output is checked
before it touches any state; the queue of waiting sequences is bounded."""

from __future__ import annotations

import pytest

from pagedserve.common.messages import (
    ErrorKind,
    FinishReason,
    SamplingParams,
    StepOutput,
    SubmitRequest,
    TokenLogprobs,
)
from pagedserve.scheduler import search
from pagedserve.scheduler.scheduler import Scheduler
from tests.scheduler.conftest import OWNER, Harness, make_harness


def _assert_nothing_left(h: Harness, num_blocks: int = 64) -> None:
    s = h.scheduler
    s.check_invariants()
    assert s.num_requests == 0 and not s._seqs
    assert s._running.beam_reserve == 0 and s._running.pending_forks == 0
    assert s.block_manager.num_free_blocks == num_blocks


def _submit_mix(h: Harness) -> None:
    assert h.submit("a", [1, 2, 3, 4, 5], max_tokens=12) is None
    assert h.submit("bad", [6, 7, 8, 9, 10, 11], max_tokens=12, n=3) is None
    assert h.submit("c", [12, 13], max_tokens=9, n=2) is None


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_fault_while_taking_one_requests_token_fails_only_that_request(monkeypatch, pipelined):
    """Defect: an exception in update() escaped the core and ended the scheduler process."""
    take = Scheduler._take_token

    def faulty(self, seq, token, logprobs, outputs, now):
        if seq.request.request_id == "bad" and len(seq.token_ids) > 8:
            raise ZeroDivisionError("injected")
        return take(self, seq, token, logprobs, outputs, now)

    monkeypatch.setattr(Scheduler, "_take_token", faulty)
    h = make_harness(pipelined=pipelined)
    _submit_mix(h)
    h.run()
    assert h.errors["bad"].kind == ErrorKind.INTERNAL and set(h.errors) == {"bad"}
    assert [h.finish[("a", 0)], h.finish[("c", 0)], h.finish[("c", 1)]] == [FinishReason.LENGTH] * 3
    assert len(h.tokens[("a", 0)]) == 12 and len(h.tokens[("c", 1)]) == 9
    assert h.scheduler.metrics.requests_failed_total == 1
    _assert_nothing_left(h)


@pytest.mark.parametrize("pipelined", [False, True])
def test_a_fault_in_the_beam_search_fails_only_that_search(monkeypatch, pipelined):
    select = search.select

    def faulty(group, beams, stop_ids):
        if group.width == 3 and len(beams[0][0]) == 4:
            raise OverflowError("injected")
        return select(group, beams, stop_ids)

    monkeypatch.setattr(search, "select", faulty)
    h = make_harness(pipelined=pipelined)
    params = dict(temperature=0.0, max_tokens=8)
    assert h.submit("beam3", [1, 2, 3], beam_width=3, n=2, **params) is None
    assert h.submit("beam2", [4, 5, 6], beam_width=2, n=2, **params) is None
    assert h.submit("plain", [7, 8], max_tokens=10) is None
    h.run()
    assert set(h.errors) == {"beam3"}
    assert ("beam3", 0) not in h.finish
    assert {k for k in h.finish if k[0] != "beam3"} == {("beam2", 0), ("beam2", 1), ("plain", 0)}
    _assert_nothing_left(h)


def test_a_fault_while_queueing_keeps_nothing_of_the_request(monkeypatch):
    queue = Scheduler._queue_request

    def faulty(self, request):
        queue(self, request)  # everything made and queued, then the fault
        if request.request_id == "bad":
            raise KeyError("injected")

    monkeypatch.setattr(Scheduler, "_queue_request", faulty)
    h = make_harness()
    assert h.submit("a", [1, 2, 3], max_tokens=5) is None
    assert h.submit("bad", [1, 2, 3], max_tokens=5, n=4) == "internal error (KeyError)"
    assert h.scheduler.num_requests == 1 and h.scheduler.num_queued_seqs == 1
    h.run()
    assert set(h.finish) == {("a", 0)}
    _assert_nothing_left(h)


def test_a_malformed_request_is_refused_not_raised():
    h = make_harness()
    msg = SubmitRequest("x", [1, 2], SamplingParams(n=[2]))  # type: ignore[arg-type]
    error = h.scheduler.add_request(OWNER, msg)
    assert error is not None and error.kind == ErrorKind.INVALID_REQUEST
    msg = SubmitRequest(["x"], [1, 2], SamplingParams())  # type: ignore[arg-type]
    assert h.scheduler.add_request(OWNER, msg).kind == ErrorKind.INVALID_REQUEST
    assert h.scheduler.num_requests == 0


def test_a_fault_while_aborting_still_ends_the_request(monkeypatch):
    h = make_harness()
    _submit_mix(h)
    h.step()
    h.step()
    monkeypatch.setattr(Scheduler, "_output_of", staticmethod(lambda *a: 1 / 0))
    assert h.scheduler.abort(OWNER, "bad") == []
    h.record([])
    assert set(h.errors) == {"bad"}
    monkeypatch.undo()
    h.run()
    assert set(h.finish) == {("a", 0), ("c", 0), ("c", 1)}
    _assert_nothing_left(h)


def test_late_outputs_of_aborted_sequences_are_skipped():
    h = make_harness(pipelined=True)
    assert h.submit("a", [1, 2, 3, 4], max_tokens=20, n=2) is None
    assert h.submit("b", [5, 6, 7, 8], max_tokens=20, beam_width=2, temperature=0.0) is None
    assert h.submit("c", [9, 10], max_tokens=6) is None
    for _ in range(4):
        h.step()
    assert len(h.in_flight) == 1  # a step with tokens of "a" and "b" is still out
    h.record(h.scheduler.abort(OWNER, "a"))
    h.record(h.scheduler.abort(OWNER, "b", finish_reason=FinishReason.STOP))
    h.run()
    assert not h.errors and h.finish[("c", 0)] == FinishReason.LENGTH
    assert h.finish[("a", 0)] == h.finish[("a", 1)] == FinishReason.ABORT
    _assert_nothing_left(h)


# ------------------------------------------------------------------------------------------------------------
# the worker's output, checked before update()


def _first_output(h: Harness) -> StepOutput:
    plan = h.scheduler.schedule()
    return h.worker.execute(plan)


def test_check_output_accepts_what_the_worker_sends():
    h = make_harness()
    _submit_mix(h)
    assert h.submit("beam", [3, 4], max_tokens=4, beam_width=2, temperature=0.0) is None
    assert h.submit("lp", [3, 4], max_tokens=4, logprobs=2) is None
    while h.scheduler.has_work:
        out = _first_output(h)
        if out.seq_ids or h.scheduler._sampling:
            assert h.scheduler.check_output(out) is None
        h.record(h.scheduler.update(out))
        h.scheduler.check_invariants()
    assert not h.errors


@pytest.mark.parametrize(
    "corrupt,problem",
    [
        (lambda o: setattr(o, "step_id", o.step_id + 7), "not in flight"),
        (lambda o: setattr(o, "step_id", [0]), "not in flight"),
        (lambda o: o.token_ids.pop(), "token ids"),
        (lambda o: setattr(o, "seq_ids", [o.seq_ids[0]] * len(o.seq_ids)), "twice"),
        (lambda o: setattr(o, "seq_ids", o.seq_ids[:-1] + [999]), "unexpected [999]"),
        (lambda o: o.seq_ids.__setitem__(0, "0"), "integers"),
        (lambda o: o.token_ids.__setitem__(0, 1000), "outside the vocabulary"),
        (lambda o: o.token_ids.__setitem__(0, -1), "outside the vocabulary"),
        (lambda o: setattr(o, "gpu_time_s", float("nan")), "finite"),
        (lambda o: setattr(o, "seq_ids", None), "lists"),
    ],
)
def test_check_output_refuses_malformed_outputs(corrupt, problem):
    h = make_harness()
    _submit_mix(h)
    out = _first_output(h)
    corrupt(out)
    assert problem in h.scheduler.check_output(out)


def test_check_output_refuses_bad_beam_candidates_and_logprobs():
    h = make_harness()
    assert h.submit("beam", [3, 4], max_tokens=4, beam_width=2, temperature=0.0) is None
    assert h.submit("lp", [5, 6], max_tokens=4, logprobs=2) is None
    out = _first_output(h)
    beam, lp = out.seq_ids.index(0), out.seq_ids.index(1)
    good = out.logprobs[beam]
    bad_reports = [
        None,
        TokenLogprobs(-0.1, [], []),
        TokenLogprobs(-0.1, [1, 2, 3, 4, 5], [-1.0] * 5),  # more than 2W
        TokenLogprobs(-0.1, [1, 1], [-1.0, -2.0]),
        TokenLogprobs(-0.1, [1, 2], [-1.0, float("nan")]),
        TokenLogprobs(-0.1, [1, 5000], [-1.0, -2.0]),
        TokenLogprobs(-0.1, [1, 2], [-1.0]),
    ]
    for report in bad_reports:
        out.logprobs[beam] = report
        assert "seq 0" in h.scheduler.check_output(out), report
    out.logprobs[beam] = good
    out.logprobs[lp] = TokenLogprobs(float("inf"), [1, 2], [-1.0, -2.0])
    assert "seq 1" in h.scheduler.check_output(out)
    out.logprobs[lp] = TokenLogprobs(-1.0, [1, 2], [-1.0, float("-inf")])
    assert h.scheduler.check_output(out) is None


@pytest.mark.parametrize("pipelined", [False, True])
def test_fail_step_ends_the_requests_of_a_refused_output_and_the_rest_go_on(pipelined):
    h = make_harness(pipelined=pipelined)
    _submit_mix(h)
    h.step()
    h.step()
    while h.in_flight:
        h.record(h.scheduler.update(h.in_flight.popleft()))
    plan = h.scheduler.schedule()
    out = h.worker.execute(plan)
    assert h.submit("later", [1, 2, 3], max_tokens=4) is None  # not in the refused step
    out.token_ids[0] = -5
    assert h.scheduler.check_output(out) is not None
    failed = {h.scheduler._seqs[i].request.request_id for i in h.scheduler._sampling[plan.step_id]}
    h.record(h.scheduler.update(h.scheduler.fail_step(plan.step_id)))
    assert set(h.errors) == failed
    h.run()
    assert h.finish[("later", 0)] == FinishReason.LENGTH
    assert all(key[0] not in failed for key in h.finish if key[0] != "later")
    _assert_nothing_left(h)


# ------------------------------------------------------------------------------------------------------------
# bounded queue


def test_requests_beyond_max_waiting_seqs_are_refused_as_unavailable():
    """Defect: 20,000 prompts x n=128 sent to the scheduler took +1.3 GB; now the queue is bounded."""
    h = make_harness(max_waiting_seqs=8)
    assert h.submit("a", [1, 2, 3], max_tokens=4, n=6) is None
    for params in (dict(n=3), dict(beam_width=3, temperature=0.0)):
        error = h.scheduler.add_request(
            OWNER, SubmitRequest("c", [1], SamplingParams(max_tokens=2, **params))
        )
        assert error.kind == ErrorKind.UNAVAILABLE and "overloaded" in error.message
    error = h.scheduler.add_request(OWNER, SubmitRequest("d", [1], SamplingParams(max_tokens=2, n=9)))
    assert error.kind == ErrorKind.INVALID_REQUEST  # could never be queued: retrying would not help
    assert h.submit("e", [1, 2], max_tokens=3, n=2) is None
    assert h.scheduler.metrics.requests_overloaded_total == 2
    h.step()  # running sequences leave the queue: there is room again
    assert h.submit("c", [1], max_tokens=2, n=3) is None
    h.run()
    assert len(h.finish) == 6 + 2 + 3
    _assert_nothing_left(h)


def test_a_fault_even_in_finishing_a_sequence_drops_it_by_force(monkeypatch):
    finish = Scheduler._finish

    def faulty(self, seq, reason):
        if seq.request.request_id == "bad":
            raise RuntimeError("injected")
        return finish(self, seq, reason)

    monkeypatch.setattr(Scheduler, "_finish", faulty)
    h = make_harness(num_blocks=40, preemption_mode="recompute")
    _submit_mix(h)
    assert h.submit("d", [1] * 9, max_tokens=20, n=2) is None
    h.run()
    assert set(h.errors) == {"bad"}
    assert {k[0] for k in h.finish} == {"a", "c", "d"}
    _assert_nothing_left(h, num_blocks=40)


@pytest.mark.parametrize("trial", range(2))
def test_random_faults_in_random_requests_leave_the_rest_exact(monkeypatch, trial):
    """Faults injected into random requests (their tokens, their searches) while others run, preempt, swap and
    abort: every other request streams exactly what it would have without them, and every block returns."""
    import random

    from tests.scheduler.test_memory_management import _random_arrivals, _run_arrivals

    rng = random.Random(2000 + trial)
    arrivals = _random_arrivals(rng)
    reference = _run_arrivals(arrivals, 1024, aborts=False, enable_prefix_caching=False)
    doomed = {a[1] for a in arrivals if rng.random() < 0.3}
    take = Scheduler._take_token

    def faulty(self, seq, token, logprobs, outputs, now):
        if seq.request.request_id in doomed and rng.random() < 0.2:
            raise ValueError("injected")
        return take(self, seq, token, logprobs, outputs, now)

    monkeypatch.setattr(Scheduler, "_take_token", faulty)
    for config in (
        dict(num_blocks=24, enable_prefix_caching=True),
        dict(num_blocks=24, preemption_mode="swap", num_cpu_blocks=64, pipelined=True),
    ):
        h = _run_arrivals(arrivals, aborts=False, **config)  # (it checks that every block came back)
        assert h.errors and set(h.errors) <= doomed
        for key, tokens in reference.tokens.items():
            if key[0] in h.errors:
                assert h.tokens[key] == tokens[: len(h.tokens[key])], (config, key)
            else:
                assert h.tokens[key] == tokens and h.finish[key] == reference.finish[key], (config, key)
