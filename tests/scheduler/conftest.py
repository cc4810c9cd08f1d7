"""Factories and helpers for scheduler tests: a scheduler, a fake worker, and a loop that runs them."""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass, field

import pytest

from pagedserve.common.messages import RequestError, SamplingParams, SeqOutput, StepOutput, SubmitRequest
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.settings import SchedulerSettings
from tests.scheduler.fake_worker import FakeWorker

OWNER = b"client-0"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 0.001
        return self.now


@dataclass
class Harness:
    scheduler: Scheduler
    worker: FakeWorker
    # (request_id, index) -> tokens streamed so far, and the finish reason once finished
    tokens: dict[tuple[str, int], list[int]] = field(default_factory=lambda: defaultdict(list))
    finish: dict[tuple[str, int], str] = field(default_factory=dict)
    errors: dict[str, RequestError] = field(default_factory=dict)  # request_id -> the error that ended it
    steps: int = 0
    # Async scheduling as the server does it: plan N+1 is made before step N's output is applied (the fake
    # worker runs each plan at once; its output waits in `in_flight`, as it would on the wire).
    pipelined: bool = False
    in_flight: deque[StepOutput] = field(default_factory=deque)

    def submit(self, request_id: str, prompt: list[int], owner: bytes = OWNER, **params) -> str | None:
        error = self.scheduler.add_request(owner, SubmitRequest(request_id, prompt, SamplingParams(**params)))
        return None if error is None else error.message

    def record(self, outputs: list[tuple[bytes, SeqOutput]]) -> None:
        for _, out in outputs:
            key = (out.request_id, out.index)
            assert key not in self.finish, f"output for {key} after it finished"
            assert out.request_id not in self.errors, f"output for {out.request_id} after its error"
            self.tokens[key].extend(out.token_ids)
            if out.finish_reason is not None:
                self.finish[key] = out.finish_reason
        for _, error in self.scheduler.take_errors():
            assert error.request_id not in self.errors, f"two errors for {error.request_id}"
            self.errors[error.request_id] = error

    def step(self) -> None:
        plan = self.scheduler.schedule()
        self.scheduler.check_invariants()
        if not self.pipelined:
            output = self.worker.execute(plan)
            self.record(self.scheduler.update(output if plan.is_noop else self._checked(output)))
        else:
            if not plan.is_noop:  # a plan that changes nothing is not sent
                self.in_flight.append(self.worker.execute(plan))
            # (as the server: a plan that would draft waits for the tokens in flight)
            ahead = plan.scheduled_seq_ids and not self.scheduler.speculating
            if len(self.in_flight) > 1 or (self.in_flight and not ahead):
                self.record(self.scheduler.update(self._checked(self.in_flight.popleft())))
        self.scheduler.check_invariants()
        self.steps += 1

    def _checked(self, output: StepOutput) -> StepOutput:
        """As the server: every answer of a sent plan passes the scheduler's check."""
        problem = self.scheduler.check_output(output)
        assert problem is None, problem
        return output

    @property
    def busy(self) -> bool:
        return self.scheduler.has_work or bool(self.in_flight)

    def run(self, max_steps: int = 10_000) -> None:
        while self.busy:
            assert self.steps < max_steps, "the scheduler made no progress"
            self.step()


def make_harness(
    num_blocks: int = 64,
    block_size: int = 4,
    max_model_len: int = 256,
    vocab_size: int = 1000,
    eos_token_ids: tuple[int, ...] = (),
    max_num_seqs: int = 16,
    max_num_batched_tokens: int = 64,
    pipelined: bool = False,
    **policies,
) -> Harness:
    settings = SchedulerSettings(
        num_kv_blocks=num_blocks,
        block_size=block_size,
        max_model_len=max_model_len,
        vocab_size=vocab_size,
        eos_token_ids=eos_token_ids,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        **policies,
    )
    worker = FakeWorker(
        num_blocks,
        block_size,
        vocab_size,
        policies.get("num_cpu_blocks", 0),
        policies.get("sliding_window", 0),
    )
    return Harness(Scheduler(settings, clock=FakeClock()), worker, pipelined=pipelined)


@pytest.fixture
def harness_factory():
    return make_harness
