"""The scheduler core through its own API (no sockets), with a fake worker and invariants every step."""

from __future__ import annotations

import random

import pytest

from pagedserve.common.messages import FinishReason, SamplingParams, StepOutput, SubmitRequest
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.settings import SchedulerSettings
from tests.scheduler.conftest import OWNER, FakeClock, make_harness


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000) for _ in range(n)]


def test_every_request_gets_exactly_max_tokens_and_all_blocks_come_back():
    h = make_harness()
    rng = random.Random(0)
    for i in range(10):
        assert h.submit(f"r{i}", _prompt(rng, rng.randint(1, 30)), max_tokens=rng.randint(1, 20)) is None
    h.run()
    assert len(h.finish) == 10 and set(h.finish.values()) == {FinishReason.LENGTH}
    assert h.scheduler.block_manager.num_free_blocks == 64
    assert h.scheduler.num_requests == 0 and not h.scheduler._seqs


def test_output_lengths_match_max_tokens():
    h = make_harness()
    wanted = {"a": 1, "b": 7, "c": 19}
    for rid, m in wanted.items():
        h.submit(rid, [1, 2, 3, 4, 5], max_tokens=m)
    h.run()
    assert {rid: len(h.tokens[(rid, 0)]) for rid in wanted} == wanted


def test_budgets_are_respected_in_every_plan():
    h = make_harness(num_blocks=256, max_num_seqs=3, max_num_batched_tokens=10)
    rng = random.Random(1)
    for i in range(8):
        h.submit(f"r{i}", _prompt(rng, rng.randint(1, 25)), max_tokens=5)
    h.run()
    for plan in h.worker.plans:
        assert len(plan.scheduled_seq_ids) <= 3
        assert sum(plan.num_scheduled_tokens) <= 10
    assert len(h.finish) == 8


def test_admission_is_first_come_first_served():
    h = make_harness(num_blocks=256, max_num_seqs=2, max_num_batched_tokens=100)
    for i in range(6):
        h.submit(f"r{i}", [i + 1] * 5, max_tokens=3)
    h.run()
    admitted = [new.seq_id for plan in h.worker.plans for new in plan.new_seqs]
    assert admitted == sorted(admitted) == list(range(6))


def test_long_prompt_is_chunked_and_running_decodes_go_first():
    h = make_harness(num_blocks=256, max_num_batched_tokens=8)
    h.submit("short", [1, 2, 3], max_tokens=20)
    h.step()  # prefill of "short"
    h.submit("long", list(range(1, 31)), max_tokens=2)
    h.step()
    plan = h.worker.plans[-1]
    # the running sequence decodes one token, the new prompt gets the rest of the budget
    assert plan.scheduled_seq_ids == [0, 1] and plan.num_scheduled_tokens == [1, 7]
    h.run()
    long_chunks = [
        n
        for p in h.worker.plans
        for s, n in zip(p.scheduled_seq_ids, p.num_scheduled_tokens, strict=True)
        if s == 1
    ]
    assert long_chunks[:5] == [7, 7, 7, 7, 2] and all(n == 1 for n in long_chunks[5:])
    assert len(h.tokens[("long", 0)]) == 2


def test_preemption_when_the_pool_runs_out_gives_identical_streams():
    rng = random.Random(2)
    requests = [(f"r{i}", _prompt(rng, rng.randint(4, 20)), rng.randint(10, 40)) for i in range(12)]

    def run(num_blocks: int):
        h = make_harness(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=32)
        for rid, prompt, max_tokens in requests:
            assert h.submit(rid, prompt, max_tokens=max_tokens, seed=7) is None
        h.run()
        return h

    big, tiny = run(512), run(16)
    assert big.scheduler.metrics.preemptions_total == 0
    assert tiny.scheduler.metrics.preemptions_total > 0
    assert dict(tiny.tokens) == dict(big.tokens)
    for rid, _, max_tokens in requests:
        assert len(tiny.tokens[(rid, 0)]) == max_tokens
    assert tiny.scheduler.block_manager.num_free_blocks == 16


def test_newest_running_sequence_is_preempted_first():
    h = make_harness(num_blocks=12, block_size=4, max_num_batched_tokens=64)
    assert h.submit("old", [1] * 8, max_tokens=30) is None
    assert h.submit("new", [2] * 8, max_tokens=30) is None
    h.step()  # both prefilled: 2 blocks each
    while h.scheduler.metrics.preemptions_total == 0:
        assert h.steps < 100
        h.step()
    preempted = [s for p in h.worker.plans for s in p.freed_seq_ids]
    assert preempted[0] == 1  # "new" went first
    h.run()
    assert len(h.tokens[("old", 0)]) == 30 and len(h.tokens[("new", 0)]) == 30


def test_requests_that_can_never_fit_are_refused_and_others_proceed():
    h = make_harness(num_blocks=8, block_size=4, max_model_len=64, vocab_size=100)
    assert "maximum context length" in h.submit("too-long", [1] * 60, max_tokens=10)
    assert "whole pool" in h.submit("too-big", [1] * 30, max_tokens=10)  # 40 tokens need 10 blocks
    assert "vocabulary" in h.submit("bad-token", [1, 100], max_tokens=1)
    assert "vocabulary" in h.submit("neg-token", [-1], max_tokens=1)
    assert "empty" in h.submit("empty", [], max_tokens=1)
    assert "n must be" in h.submit("n0", [1], n=0)
    assert "max_tokens" in h.submit("m0", [1], max_tokens=0)
    assert h.submit("ok", [1, 2, 3], max_tokens=5) is None
    assert "already in use" in h.submit("ok", [1], max_tokens=1)
    h.run()
    assert h.finish == {("ok", 0): FinishReason.LENGTH}
    assert h.scheduler.metrics.requests_rejected_total == 8


def test_abort_frees_blocks_at_once_and_the_worker_is_told():
    h = make_harness(num_blocks=32)
    h.submit("a", [1] * 10, max_tokens=50)
    h.submit("b", [2] * 10, max_tokens=5)
    h.step()
    h.step()
    used_before = h.scheduler.block_manager.num_used_blocks
    h.record(h.scheduler.abort(OWNER, "a"))
    assert h.finish[("a", 0)] == FinishReason.ABORT
    assert h.scheduler.block_manager.num_used_blocks < used_before
    h.scheduler.check_invariants()
    h.run()
    assert 0 in [s for p in h.worker.plans for s in p.freed_seq_ids]
    assert 0 not in h.worker.seqs
    assert h.scheduler.block_manager.num_free_blocks == 32


def test_abort_of_a_waiting_request_and_of_one_sequence():
    h = make_harness(num_blocks=256, max_num_seqs=1)
    h.submit("first", [1, 2], max_tokens=5)
    h.submit("queued", [3, 4], max_tokens=5)
    h.submit("pair", [5, 6], max_tokens=5, n=2)
    h.step()
    h.record(h.scheduler.abort(OWNER, "queued"))
    h.record(h.scheduler.abort(OWNER, "pair", index=1, finish_reason=FinishReason.STOP))
    h.run()
    assert h.tokens[("queued", 0)] == [] and h.finish[("queued", 0)] == FinishReason.ABORT
    assert h.finish[("pair", 1)] == FinishReason.STOP and h.tokens[("pair", 1)] == []
    assert len(h.tokens[("pair", 0)]) == 5
    assert h.scheduler.num_requests == 0


def test_stop_on_eos_and_stop_token_ids_unless_ignore_eos():
    from tests.scheduler.fake_worker import fake_next_token

    prompt = [5, 6, 7]
    first = fake_next_token(11, prompt, 1000)
    h = make_harness(eos_token_ids=(first,))
    h.submit("eos", prompt, max_tokens=10, seed=11)
    h.submit("ignore", prompt, max_tokens=10, seed=11, ignore_eos=True)
    h.submit("stop-id", prompt, max_tokens=10, seed=11, stop_token_ids=(999_999, first))
    h.run()
    assert h.tokens[("eos", 0)] == [first] and h.finish[("eos", 0)] == FinishReason.STOP
    assert len(h.tokens[("ignore", 0)]) == 10 and h.finish[("ignore", 0)] == FinishReason.LENGTH
    assert h.tokens[("stop-id", 0)] == [first] and h.finish[("stop-id", 0)] == FinishReason.STOP


def test_same_seed_same_tokens_and_n_sequences_differ():
    h = make_harness(num_blocks=256)
    h.submit("a", [1, 2, 3], max_tokens=8, seed=5, n=3)
    h.submit("b", [1, 2, 3], max_tokens=8, seed=5, n=3)
    h.submit("c", [1, 2, 3], max_tokens=8, seed=6)
    h.run()
    for i in range(3):
        assert h.tokens[("a", i)] == h.tokens[("b", i)]
    assert len({tuple(h.tokens[("a", i)]) for i in range(3)}) == 3
    assert h.tokens[("c", 0)] != h.tokens[("a", 0)]


def test_logprobs_arrive_one_per_token_when_asked():
    h = make_harness()
    h.submit("lp", [1, 2], max_tokens=4, logprobs=2)
    h.submit("none", [1, 2], max_tokens=4)
    seen = {}
    while h.scheduler.has_work:
        plan = h.scheduler.schedule()
        for _, out in h.scheduler.update(h.worker.execute(plan)):
            seen.setdefault(out.request_id, []).append(out)
    assert all(len(o.logprobs) == len(o.token_ids) for o in seen["lp"])
    assert all(len(lp.top_token_ids) == 2 for o in seen["lp"] for lp in o.logprobs)
    assert all(o.logprobs is None for o in seen["none"])


def test_metrics_text_counts_tokens_and_blocks():
    h = make_harness(num_blocks=16, block_size=4)
    h.submit("a", [1] * 6, max_tokens=3)
    h.step()
    text = h.scheduler.metrics_text()
    assert "pagedserve_requests_running 1.0" in text
    assert "pagedserve_kv_blocks_used 2.0" in text
    assert "pagedserve_prompt_tokens_total 6.0" in text
    h.run()
    text = h.scheduler.metrics_text()
    assert "pagedserve_kv_blocks_used 0.0" in text and "pagedserve_kv_blocks_total 16.0" in text
    assert "pagedserve_generated_tokens_total 3.0" in text
    assert "pagedserve_time_to_first_token_seconds_count 1.0" in text
    assert "pagedserve_inter_token_latency_seconds_count 2.0" in text


def test_decodes_go_before_an_earlier_queued_prefill():
    """Under the priority policy an urgent long prompt sorts before a running decode; its chunks must
    still leave the decode its token every step."""
    from pagedserve.common.messages import SamplingParams, SubmitRequest

    h = make_harness(num_blocks=256, max_num_batched_tokens=8, scheduling_policy="priority")
    h.scheduler.add_request(OWNER, SubmitRequest("decoding", [1, 2, 3], SamplingParams(max_tokens=20), 5))
    h.step()
    h.scheduler.add_request(OWNER, SubmitRequest("urgent", list(range(40)), SamplingParams(max_tokens=2), 0))
    while len(h.tokens[("urgent", 0)]) == 0:
        h.step()
        plan = h.worker.plans[-1]
        assert dict(zip(plan.scheduled_seq_ids, plan.num_scheduled_tokens, strict=True))[0] == 1
        assert sum(plan.num_scheduled_tokens) <= 8
    assert h.scheduler._running[0].request.request_id == "urgent"  # it was first in queue order
    h.run()


def test_gpu_time_is_summed_and_decode_steps_are_timed_on_the_gpu_clock():
    clock = FakeClock()
    scheduler = Scheduler(
        SchedulerSettings(
            num_kv_blocks=16, block_size=4, max_model_len=64, vocab_size=100, eos_token_ids=(),
            max_num_seqs=4, max_num_batched_tokens=64,
        ),
        clock=clock,
    )  # fmt: skip
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert scheduler.add_request(b"c", SubmitRequest("r", [1, 2, 3, 4, 5], params)) is None
    gpu_times = [0.5, 0.25, 0.125]  # the prefill step, then two decode-only steps
    idle_times = [2.0, 0.0625, 0.03125]  # the GPU's idle time before each
    for gpu_time_s, idle_s in zip(gpu_times, idle_times, strict=True):
        plan = scheduler.schedule()
        clock.now += 1.0  # wall time on the host does not count: the worker may answer late
        out = StepOutput(plan.step_id, list(plan.scheduled_seq_ids), [7], [None], gpu_time_s, idle_s)
        scheduler.update(out)
    m = scheduler.metrics
    assert (m.steps_total, m.decode_steps_total) == (3, 2)
    assert m.gpu_seconds_total == sum(gpu_times)
    assert m.decode_gpu_seconds_total == 0.25 + 0.125
    assert m.decode_step_seconds_total == 0.25 + 0.0625 + 0.125 + 0.03125
    assert "pagedserve_decode_step_seconds_total " in scheduler.metrics_text()


# ----------------------------------------------------------------------------------------------------------
# async scheduling: each plan is made before the previous step's tokens are applied


def _total_scheduled(h) -> int:
    return sum(sum(plan.num_scheduled_tokens) for plan in h.worker.plans)


def test_pipelined_plans_decode_tokens_still_in_flight_and_compute_nothing_extra_at_max_tokens():
    serial, piped = make_harness(), make_harness(pipelined=True)
    for h in (serial, piped):
        for i, (length, max_tokens) in enumerate([(5, 6), (11, 3), (2, 9)]):
            h.submit(f"r{i}", list(range(1, length + 1)), max_tokens=max_tokens, seed=i)
    piped.step()  # the prefills: their first tokens are still in flight
    assert not piped.tokens and len(piped.in_flight) == 1
    piped.step()  # so the plan decodes them before they arrive; then the first step's tokens come in
    plan = piped.worker.plans[1]
    assert plan.num_scheduled_tokens == [1, 1, 1] and not plan.new_seqs
    assert all(len(tokens) == 1 for tokens in piped.tokens.values())
    serial.run()
    piped.run()
    assert piped.tokens == serial.tokens and piped.finish == serial.finish
    # A sequence is not scheduled past the token that ends it by length: no plan computes a wasted token.
    assert _total_scheduled(piped) == _total_scheduled(serial)
    assert len(piped.worker.plans) == len(serial.worker.plans) == 9
    assert piped.scheduler.block_manager.num_free_blocks == 64 and not piped.scheduler._seqs


def test_pipelined_stop_token_costs_one_ignored_token_and_frees_everything():
    serial, piped = make_harness(), make_harness(pipelined=True)
    prompt = [7, 8, 9]
    serial.submit("probe", prompt, max_tokens=8, seed=5)
    serial.run()
    stop = serial.tokens[("probe", 0)][2]  # the third token will end the sequence
    serial, piped = make_harness(), make_harness(pipelined=True)
    for h in (serial, piped):
        h.submit("s", prompt, max_tokens=8, seed=5, stop_token_ids=[stop])
        h.submit("long", [1, 2, 3, 4], max_tokens=8, seed=6)
        h.run()
    assert piped.tokens == serial.tokens and piped.finish[("s", 0)] == FinishReason.STOP
    assert len(piped.tokens[("s", 0)]) == 3
    # The plan sent before the stop token arrived computed one token of "s" whose output was ignored.
    assert _total_scheduled(piped) == _total_scheduled(serial) + 1
    assert piped.scheduler.block_manager.num_free_blocks == 64 and not piped.scheduler._seqs
    # the worker was told to free "s"; the last frees ride on the next plan that runs
    assert set(piped.worker.seqs) == set(piped.scheduler._freed_seq_ids) == {1}


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_pipelined_preemption_keeps_the_token_in_flight(mode):
    """A sequence preempted while its token is in flight keeps that token (no resampling, no gap)."""
    policies = dict(num_blocks=10, block_size=4, max_num_batched_tokens=64, preemption_mode=mode)
    if mode == "swap":
        policies["num_cpu_blocks"] = 32
    serial, piped = make_harness(**policies), make_harness(pipelined=True, **policies)
    for h in (serial, piped):
        for i in range(4):
            h.submit(f"r{i}", [i + 1] * 6, max_tokens=10, seed=i)
        h.run()
    assert piped.scheduler.metrics.preemptions_total > 0
    assert piped.tokens == serial.tokens and set(piped.finish.values()) == {FinishReason.LENGTH}
    assert piped.scheduler.block_manager.num_free_blocks == 10
    assert set(piped.worker.seqs) <= set(piped.scheduler._freed_seq_ids)  # freed with the next plan
