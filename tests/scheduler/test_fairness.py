"""Admission is fair between requests: one request's many sequences cannot starve the others."""

from __future__ import annotations

from pagedserve.common.messages import FinishReason, SamplingParams, SubmitRequest
from pagedserve.scheduler.request import SeqStatus
from tests.scheduler.conftest import OWNER, make_harness

M = 30  # tokens each sequence of the big requests generates


def _big_requests(h, count: int = 4, n: int = 64) -> None:
    for i in range(count):
        assert h.submit(f"big{i}", [10 * i + j for j in range(8)], max_tokens=M, n=n, ignore_eos=True) is None


def _wait_of_a_small_request(**policies) -> tuple[int, object]:
    """Steps from submitting a 1-sequence request, behind four prompts x n=64 holding all 64 seats, to its
    first token."""
    h = make_harness(
        num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=128, **policies
    )
    _big_requests(h)
    for _ in range(3):
        h.step()
    assert h.scheduler.num_running_seqs == 64
    assert h.submit("small", [7, 7, 7], max_tokens=4) is None
    submitted = h.steps
    while not h.tokens.get(("small", 0)):
        h.step()
    return h.steps - submitted, h


def test_a_one_sequence_request_is_not_starved_by_many_sequence_requests():
    """Defect: 8 prompts x n=128 (1,024 sequences) kept a 4-token request waiting over 60 s. Under first come,
    first served the small request would wait for the last big prompt to be admitted whole: four generations
    of M steps. Now it gets one of the first seats that free."""
    waited, h = _wait_of_a_small_request()
    assert waited <= M  # the running sequences end within M steps; the small one goes next
    big3 = h.scheduler._requests[(OWNER, "big3")]
    # FCFS cannot do this: big3 arrived first, and its sequences would all be admitted before "small"
    assert any(s.status in (SeqStatus.WAITING, SeqStatus.FORK_PENDING) for s in big3.seqs)
    h.run()
    assert h.finish[("small", 0)] == FinishReason.LENGTH and len(h.tokens[("small", 0)]) == 4
    for i in range(4):
        assert all(len(h.tokens[(f"big{i}", k)]) == M for k in range(64))  # the big ones complete too
    assert h.scheduler.num_requests == 0 and h.scheduler.block_manager.num_free_blocks == 1024
    # Without the seat quota each prompt takes its 64 seats at once, as FCFS admitted them: the small request
    # waits behind every one of them.
    waited_whole_groups, _ = _wait_of_a_small_request(request_seat_quota=64)
    assert waited_whole_groups > 3 * M


def test_requests_with_sequences_waiting_take_seats_in_turn():
    h = make_harness(num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=128)
    _big_requests(h)
    h.step()
    seats = {f"big{i}": 0 for i in range(4)}
    for seq in h.scheduler._running:
        seats[seq.request.request_id] += 1
    assert seats == {f"big{i}": 16 for i in range(4)}  # 8 seats each at admission (64 // 8), then in turn
    h.run()
    assert h.scheduler.block_manager.num_free_blocks == 1024


def test_a_lone_request_forks_all_its_samples_and_fcfs_holds_for_single_sequences():
    h = make_harness(num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=1024, max_model_len=128)
    _big_requests(h, count=1)
    h.step()
    assert len(h.worker.plans[0].forks) == 63  # nobody else waits: one prefill, 63 forks
    for i in range(5):
        assert h.submit(f"s{i}", [i + 1] * 5, max_tokens=3) is None
    h.run()
    admitted = [new.seq_id for plan in h.worker.plans[1:] for new in plan.new_seqs]
    assert admitted == sorted(admitted)


def test_priority_still_comes_before_fairness():
    h = make_harness(num_blocks=1024, max_num_seqs=8, scheduling_policy="priority", max_model_len=128)
    msg = SubmitRequest("urgent-big", [1, 2, 3], SamplingParams(max_tokens=20, n=16), priority=-1)
    assert h.scheduler.add_request(OWNER, msg) is None
    msg = SubmitRequest("lazy", [4, 5, 6], SamplingParams(max_tokens=2), priority=5)
    assert h.scheduler.add_request(OWNER, msg) is None
    h.step()
    assert {s.request.request_id for s in h.scheduler._running} == {"urgent-big"}
    while h.scheduler._requests.get((OWNER, "urgent-big")) is not None:
        assert not h.tokens.get(("lazy", 0)), "a less urgent request went before the urgent one's samples"
        h.step()
    h.run()
    assert len(h.finish) == 17 and h.scheduler.block_manager.num_free_blocks == 1024


def test_the_waiting_queue_keeps_few_stale_entries():
    """Every seat change of a request with sequences waiting re-keys it: stale keys are compacted away."""
    h = make_harness(num_blocks=1024, max_num_seqs=16, max_num_batched_tokens=1024, max_model_len=128)
    _big_requests(h, count=2, n=100)
    for i in range(8):
        assert h.submit(f"s{i}", [i + 1] * 3, max_tokens=5) is None
    largest = 0
    while h.busy:
        h.step()
        largest = max(largest, len(h.scheduler._waiting))
    assert largest <= 2 * 10 + 64
    assert h.scheduler.block_manager.num_free_blocks == 1024
