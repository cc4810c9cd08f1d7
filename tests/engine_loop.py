"""One loop that drives the real scheduler core and the real ModelRunner in one process, as the servers do.

The scheduler's side plays scheduler/server.py `_run_steps`: a plan goes to the worker unless it is a no-op
(`StepPlan.is_noop`: a plan that only swaps, frees or copies goes too); with `pipelined`, up to two plans are
at the worker before the scheduler waits for the oldest one's output, except after a plan that schedules
nothing or while the next plan would draft (it needs the tokens in flight: docs/speculative.md). The
worker's side plays worker/server.py `_loop`: on each plan, `launch_forward`, then the step before it
answered, then `launch_sampling`; a step is answered on its own when the scheduler waits for it, and then,
nothing being in flight, the runner drafts ahead of the next plan as the worker does (`draft_ahead`: a
draft model's drafts for the step's drafting sequences, worker/spec/ahead.py).

Every message crosses the wire format (common.messages encode/decode) as between the processes: each plan,
each step output and each output to a client. The scheduler's invariants are checked after every
`schedule` and `update`, each step output passes `check_output`, and at the end every KV block is free
and the worker holds no prompt scores nor grammar matchers of freed sequences.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.common.messages import (
    RequestError,
    RequestOutputs,
    SamplingParams,
    SeqOutput,
    StepOutput,
    StepPlan,
    SubmitRequest,
    decode,
    encode,
)
from pagedserve.scheduler.scheduler import Scheduler
from pagedserve.scheduler.settings import SchedulerSettings
from pagedserve.worker.model_runner import ModelRunner

Request = tuple[list[int], SamplingParams]


def make_scheduler(runner: ModelRunner, **settings) -> Scheduler:
    """A scheduler core sized for `runner`'s pool and model; `settings` add or override fields (the server
    takes num_cpu_blocks and num_speculative_tokens from the worker too: pass them to swap or draft)."""
    base = dict(
        num_kv_blocks=runner.num_kv_blocks,
        block_size=runner.block_size,
        max_model_len=runner.max_model_len,
        vocab_size=runner.vocab_size,
        eos_token_ids=tuple(runner.eos_token_ids),
    )
    return Scheduler(SchedulerSettings(**{**base, **settings}))


def _wire(msg):
    return decode(encode(msg))


@dataclass
class EngineRun:
    """What a run produced. Request i is `f"{prefix}{i}"`; a request that failed has an error and may
    have some outputs before it."""

    scheduler: Scheduler
    tokens: dict[tuple[int, int], list[int]] = field(default_factory=dict)  # (request, sample index)
    outputs: dict[int, list[SeqOutput]] = field(default_factory=dict)  # every output, in order
    errors: dict[int, RequestError] = field(default_factory=dict)
    steps: int = 0  # step outputs taken by the scheduler
    in_flight: int = 0  # plans sent whose output the scheduler has not taken


class _Worker:
    """The worker loop's order around a ModelRunner (worker/server.py `_loop`), or with `split` off a
    tensor-parallel follower's (`_follow`: the whole step launched, then the one before it finished); the
    answers queue in `sent`."""

    def __init__(self, runner: ModelRunner, split: bool, draft_ahead: bool = True) -> None:
        self.runner = runner
        self.split = split
        self.draft_ahead = draft_ahead and split  # (a follower never drafts ahead: worker/spec/ahead.py)
        self.sent: deque[StepOutput] = deque()  # answered, not yet read by the scheduler

    def receive(self, plan: StepPlan) -> None:
        runner = self.runner
        assert runner.check_plan(plan) is None, runner.check_plan(plan)
        if not self.split:
            runner.launch(plan)
            while len(runner.in_flight) > 1:
                self._answer()
            return
        forwarded = runner.launch_forward(plan)
        while len(runner.in_flight) > (0 if forwarded is not None else 1):
            self._answer()
        if forwarded is not None:
            runner.launch_sampling(forwarded)

    def _answer(self) -> None:
        self.sent.append(_wire(self.runner.finish()))

    def next_output(self) -> StepOutput:
        """The oldest answer; the step is finished now if it was not answered yet."""
        if not self.sent:
            self._answer()
            if self.draft_ahead and not self.runner.in_flight:  # the scheduler plans meanwhile
                self.runner.draft_ahead()
        return self.sent.popleft()


def run_engine(
    runner: ModelRunner,
    requests: list[Request],
    pipelined: bool = False,
    *,
    arrive: Callable[[EngineRun, int], bool] | None = None,
    on_plan: Callable[[StepPlan], None] | None = None,
    after_step: Callable[[Scheduler, ModelRunner], None] | None = None,
    split_launch: bool = True,
    owner: bytes = b"test",
    prefix: str = "r",
    max_steps: int = 5000,
    draft_ahead: bool = True,
    **settings,
) -> EngineRun:
    """Runs `requests` to the end through a new scheduler core (`settings` as in `make_scheduler`) and
    `runner`, as the servers do (the module's docstring). `arrive(run, i)` says whether the next waiting
    request (index i) arrives now (default: all at once, before the first step); `on_plan` sees each plan
    sent to the worker (as decoded there); `after_step` runs after each update, for the caller's invariants.
    `split_launch` off launches each step whole before the one in flight is finished (a tensor-parallel
    follower's order) instead of the worker's forward / answer / sampler. `draft_ahead` off: no drafting
    ahead of the plans (the worker drafts ahead with a draft model on one rank)."""
    scheduler = make_scheduler(runner, **settings)
    run = EngineRun(scheduler, outputs={i: [] for i in range(len(requests))})
    worker = _Worker(runner, split_launch, draft_ahead)
    depth = 2 if pipelined else 1
    waiting = deque(enumerate(requests))
    stalls = 0  # no-op plans with nothing in flight: waiting for a request to arrive

    def admit() -> None:
        while waiting and (arrive is None or arrive(run, waiting[0][0])):
            i, (prompt, params) = waiting.popleft()
            submit = _wire(SubmitRequest(f"{prefix}{i}", prompt, params))
            error = scheduler.add_request(owner, submit)
            assert error is None, error
            collect([])  # (an add that fails a request reports it through take_errors)

    def collect(outputs) -> None:
        for out_owner, out in outputs:
            assert out_owner == owner
            out = _wire(RequestOutputs([out])).outputs[0]
            i = int(out.request_id[len(prefix) :])
            run.outputs[i].append(out)
            run.tokens.setdefault((i, out.index), []).extend(out.token_ids)
        for err_owner, error in scheduler.take_errors():
            assert err_owner == owner
            error = _wire(error)
            i = int(error.request_id[len(prefix) :])
            assert i not in run.errors, f"a second error for request {i}"
            run.errors[i] = error

    admit()
    while waiting or scheduler.has_work or run.in_flight:
        plan = scheduler.schedule()
        scheduler.check_invariants()
        if not plan.is_noop:  # (a plan that only swaps or frees must reach the worker too)
            plan = _wire(plan)
            if on_plan is not None:
                on_plan(plan)
            worker.receive(plan)
            run.in_flight += 1
        elif not run.in_flight:
            assert waiting, "nothing runs, nothing is in flight and no request is coming"
            stalls += 1
            assert stalls < max_steps, "the waiting requests never arrive"
            admit()
            continue
        if run.in_flight < depth and plan.scheduled_seq_ids and not scheduler.speculating:
            admit()
            continue
        step = worker.next_output()
        run.in_flight -= 1
        problem = scheduler.check_output(step)
        assert problem is None, problem
        collect(scheduler.update(step))
        scheduler.check_invariants()
        if after_step is not None:
            after_step(scheduler, runner)
        run.steps += 1
        assert run.steps < max_steps, "the requests did not finish"
        admit()
    assert not runner.in_flight and not worker.sent
    assert scheduler.block_manager.num_free_blocks == runner.num_kv_blocks
    assert not runner.prompt_scores
    assert set(runner.structured.matchers) <= set(runner.sequences.seqs)  # freed with their sequences
    return run


def idle(run: EngineRun, _index: int) -> bool:
    """An `arrive` rule: a request arrives once the ones before it have finished."""
    return not run.scheduler.has_work and not run.in_flight
