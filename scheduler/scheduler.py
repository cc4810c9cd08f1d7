"""The scheduler's core: pure and synchronous, no sockets, no asyncio, no torch.

`schedule()` makes the next step's plan and `update(step_output)` turns the worker's sampled tokens into
client outputs. Each step has one token budget (`max_num_batched_tokens`). It goes first to the running
sequences that decode (one token each), then to running unfinished prefills (the rest of the prompt or what
the budget allows: chunked prefill), then to swapped-out sequences coming back, then to waiting sequences,
each group in queue order. When the pool has no block for a running sequence, one gives way as the
preemption policy says (scheduler/preemption.py; the run queue picks the victim, scheduler/queues.py): it is
swapped to the CPU pool, or freed and recomputed later.

Plans may run ahead of the tokens (async scheduling): plan N+1 is sent while the worker runs plan N, so a
sequence that samples in a plan counts that token as pending, and the next plan may schedule it (the worker
appended it itself) unless it is the sequence's last by length. A stop token found in `update()` ends the
sequence then: the plan already sent computes one token too many, whose result is ignored. A sequence
preempted with a token pending waits in its queue until the token is in (the token it would produce anyway).
n > 1: sequence 0 prefills the prompt; the others are forked from it in the step its prefill completes,
sharing its blocks, and sample their first token from its logits. Beam search: each beam reports its top
candidates instead of sampling; once every live beam of a request has reported, `BeamSearch`
(scheduler/search.py) picks the next beams, which the worker makes by cloning (sharing blocks), appending
tokens and freeing.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from pagedserve.common.messages import (
    ErrorKind,
    FinishReason,
    KVSnapshot,
    RequestError,
    SeqOutput,
    StepOutput,
    StepPlan,
    SubmitRequest,
    TokenLogprobs,
)
from pagedserve.scheduler.block_manager import KVUsage
from pagedserve.scheduler.faults import CONSTRAINT_FAILED, RequestFaults
from pagedserve.scheduler.inspection import Inspection
from pagedserve.scheduler.intake import queue_request
from pagedserve.scheduler.kv_events.recorder import NO_KV_EVENTS, KVEventRecorder
from pagedserve.scheduler.kv_tiers import build_block_manager, tiers_of
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.output_check import check_step_output
from pagedserve.scheduler.passes import Admission, RunningPass
from pagedserve.scheduler.preemption import PreemptionPolicy
from pagedserve.scheduler.prompt_logprobs import prompt_logprob_outputs
from pagedserve.scheduler.queues import RunQueue, SwappedQueue
from pagedserve.scheduler.request import (
    Error,
    Output,
    Request,
    SeqStatus,
    Sequence,
    SequenceTable,
    num_seqs,
    seq_output,
)
from pagedserve.scheduler.search import BeamSearch
from pagedserve.scheduler.settings import SchedulerSettings, check_request
from pagedserve.scheduler.speculation import Speculation
from pagedserve.scheduler.step import Step
from pagedserve.scheduler.waiting import WaitingQueue

__all__ = ["Error", "Output", "Scheduler"]

log = structlog.get_logger(process="scheduler")


class Scheduler:
    """Owns the requests and their sequences; runs each step with its collaborators: the queues, the
    block manager, the preemption policy, admission and beam search."""

    def __init__(self, settings: SchedulerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        if settings.max_num_seqs < 1 or settings.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if settings.max_waiting_seqs < 1 or settings.request_seat_quota < 0:
            raise ValueError("max_waiting_seqs must be positive and request_seat_quota not negative")
        self.settings = settings
        self._preemption = PreemptionPolicy.from_settings(settings)
        # what the block manager tells of its prefix cache, for KV-aware routers (scheduler/kv_events)
        self.kv_events = KVEventRecorder(settings.block_size) if settings.kv_events else None
        self.block_manager = build_block_manager(  # with KV tiers below it when the worker has them
            settings.num_kv_blocks,
            settings.block_size,
            settings.num_host_tier_blocks,
            settings.num_disk_tier_blocks,
            settings.tier_block_bytes,
            num_cpu_blocks=settings.num_cpu_blocks if self._preemption.uses_cpu_pool else 0,
            enable_prefix_caching=settings.enable_prefix_caching and not settings.reserved,
            sliding_window=settings.freeing_window,
            kv_events=self.kv_events or NO_KV_EVENTS,
        )
        self.metrics = SchedulerMetrics()
        self._spec = Speculation(settings, self.block_manager, self.metrics)  # scheduler/speculation.py
        self._clock = clock
        self._requests: dict[tuple[bytes, str], Request] = {}
        self._seqs = SequenceTable()
        self._waiting = WaitingQueue()  # fair between requests (scheduler/waiting.py)
        self._swapped = SwappedQueue()
        self._running = RunQueue()
        self._running_pass = RunningPass(
            settings, self.block_manager, self._running, preempt=self._preempt, speculation=self._spec
        )
        self._admission = Admission(
            settings, self.block_manager, self._running, self._waiting, self._swapped, self.metrics
        )
        self._beam_search = BeamSearch(
            self._seqs, self._running, self._waiting, self.block_manager, self._preemption, self.metrics,
            finish=self._finish,
        )  # fmt: skip
        self._inspection = Inspection(
            settings, self._requests, self._seqs, self._running, self._waiting, self._swapped,
            self.block_manager, self.metrics,
        )  # fmt: skip
        self._faults = RequestFaults(
            self._requests, self._seqs, self._running, self.metrics, finish=self._finish, free=self._free
        )
        self._eos = frozenset(settings.eos_token_ids)
        self._freed_seq_ids: list[int] = []  # to tell the worker in the next plan
        self._next_step_id = 0
        self._decode_only_steps: set[int] = set()  # plans in flight whose every chunk is one token
        self._sampling: dict[int, list[int]] = {}  # step id of a plan in flight -> sequences that sample

    # ----------------------------------------------------------------------------------------------------
    # requests in and out

    def add_request(self, owner: bytes, msg: SubmitRequest) -> RequestError | None:
        """Queues the request, or returns why not (nothing of it is kept then): INVALID_REQUEST when it can
        never be served as sent, UNAVAILABLE when `max_waiting_seqs` sequences would be waiting with it
        (retry later), INTERNAL when queueing it failed."""
        try:
            if (owner, msg.request_id) in self._requests:
                problem = f"request id {msg.request_id!r} is already in use"
            else:
                problem = check_request(self.settings, msg)
        except Exception as e:  # a field of the wrong type
            problem = f"malformed request ({type(e).__name__})"
        if problem is not None:
            self.metrics.requests_rejected_total += 1
            return RequestError(msg.request_id, ErrorKind.INVALID_REQUEST, problem)
        if self.num_queued_seqs + num_seqs(msg.params) > self.settings.max_waiting_seqs:
            self.metrics.requests_overloaded_total += 1
            return RequestError(
                msg.request_id, ErrorKind.UNAVAILABLE, "the server is overloaded; retry later"
            )
        params = msg.params
        prompt = list(msg.prompt_token_ids)
        request = Request(owner, msg.request_id, prompt, params, self._clock(), msg.priority, msg.cache_salt)
        try:
            self._queue_request(request)
        except Exception as e:
            log.error("request_failed", request_id=msg.request_id, exc_info=True)
            for seq in request.seqs:  # forget what was made; its queue entries are skipped as finished
                seq.status = SeqStatus.FINISHED
                self._seqs.pop(seq.seq_id, None)
            if self._requests.get(request.key) is request:
                del self._requests[request.key]
            self.metrics.requests_failed_total += 1
            return RequestError(msg.request_id, ErrorKind.INTERNAL, f"internal error ({type(e).__name__})")
        return None

    def _queue_request(self, request: Request) -> None:
        queue_request(request, self.settings, self._eos, self._seqs, self._preemption, self._waiting)
        self._requests[request.key] = request
        self.metrics.prompt_tokens_total += len(request.prompt_token_ids)

    def abort(
        self, owner: bytes, request_id: str, index: int | None = None, finish_reason: str = FinishReason.ABORT
    ) -> list[Output]:
        """Ends one sequence of a request (or all of them); returns their final outputs. Should that fail,
        the request is ended with an error (take_errors) and nothing is returned."""
        request = self._requests.get((owner, request_id))
        if request is None:
            return []
        try:
            return self._abort(request, index, finish_reason)
        except Exception:
            self._faults.fail_request(request, "internal error while aborting the request", exc_info=True)
            return []

    def _abort(self, request: Request, index: int | None, finish_reason: str) -> list[Output]:
        owner, request_id = request.key
        if request.beam is not None:
            outputs = self._beam_search.abort(request, finish_reason)
            self._running.prune()
            return outputs
        outputs = []
        for seq in list(request.seqs):
            if seq.status is SeqStatus.FINISHED or (index is not None and seq.index != index):
                continue
            self._finish(seq, finish_reason)
            outputs.append((owner, self._output_of(seq, [], [])))
        self._running.prune()
        return outputs

    def live_requests(self) -> list[tuple[bytes, str]]:
        """(owner, request_id) of every request not yet finished."""
        return list(self._requests)

    def take_errors(self) -> list[Error]:
        """Errors of requests that the core ended because handling them failed (a bug, or a worker's output
        it could not use): each request's sequences are finished and their blocks freed, and its client gets
        one RequestError (INTERNAL) and nothing more. The server sends them after each call of `abort`,
        `update` and `fail_step` (after that call's outputs); the other requests go on."""
        return self._faults.take_errors()

    def check_output(self, step: StepOutput) -> str | None:
        """What is wrong with a worker's step output, checked before `update` touches any state: its step is
        one in flight, its lists agree in length, its sequences are exactly those that sample in that step
        (some may have finished or been aborted since), its token ids lie in [0, vocab_size), and the logprobs
        and beam candidates have the shape their requests asked for. None: `update` may take it."""
        sampling = self._sampling.get(step.step_id) if type(step.step_id) is int else None
        slotted = self._spec.slotted(step.step_id)
        return check_step_output(step, sampling, self._seqs, self.settings.vocab_size, slotted)

    def fail_step(self, step_id: int) -> StepOutput:
        """For a step in flight whose output `check_output` refused: ends every request with a sequence that
        samples in that step, with an error (take_errors) -- the worker appended their tokens itself, so
        they cannot go on without them -- and returns an empty output that the server passes to `update`
        in the refused one's place, which closes the step."""
        for seq_id in self._sampling.get(step_id, []):
            seq = self._seqs.get(seq_id)
            if seq is not None:
                self._faults.fail_request(seq.request, "the worker's output for this request was malformed")
        return StepOutput(step_id, [], [], [])

    def _free(self, seq: Sequence) -> None:
        """Returns the sequence's blocks; the worker forgets it with the next plan."""
        self.block_manager.free(seq.seq_id)
        if seq.on_worker:
            self._freed_seq_ids.append(seq.seq_id)
            seq.on_worker = False

    # ----------------------------------------------------------------------------------------------------
    # inspection (scheduler/inspection.py)

    @property
    def num_running_seqs(self) -> int:
        return len(self._running)

    @property
    def num_waiting_seqs(self) -> int:
        return self._inspection.num_waiting_seqs()

    @property
    def num_queued_seqs(self) -> int:
        """Live sequences not running (waiting, forks waiting for their prompt, swapped out): what
        `max_waiting_seqs` bounds."""
        return len(self._seqs) - len(self._running)

    @property
    def num_swapped_seqs(self) -> int:
        return self._inspection.num_swapped_seqs()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def kv_usage(self) -> KVUsage:
        return self._inspection.kv_usage()

    def metrics_text(self) -> str:
        return self._inspection.metrics_text()

    def kv_snapshot(self, max_cells: int, query_id: int = 0) -> KVSnapshot:
        return self._inspection.kv_snapshot(max_cells, self._clock(), query_id)

    def check_invariants(self) -> None:
        """Raises AssertionError when the queues, the sequences and the block manager disagree."""
        self._inspection.check_invariants()

    # ----------------------------------------------------------------------------------------------------
    # one step

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._swapped)

    @property
    def speculating(self) -> bool:
        """Whether the next plan would draft: plan it after the step in flight is in (docs/speculative.md)."""
        return self._spec.active(self._running.seqs)

    def schedule(self) -> StepPlan:
        """The next step's plan. Sequences it schedules count their tokens as computed from now on."""
        step = Step(self.block_manager, self.settings)
        if self._spec.blocks_planning():  # a drafting step in flight: its tokens first
            self._next_step_id += 1
            return step.plan(self._next_step_id - 1, [], [], [], [])
        step.spec_k = self._spec.step_k(len(self._running))
        budget = self._running_pass.schedule(step, self.settings.max_num_batched_tokens)
        if not step.preempted:  # right after a preemption, admitting more would only thrash
            budget = self._admission.swap_in(step, budget)
            if not self._swapped:
                self._admission.admit_waiting(step, budget)
        running = self._running
        while not step.scheduled and running and self._has_queued() and not running.tokens_in_flight():
            # Everything running is idle: beams waiting for a sibling that cannot get in. Make room for it.
            # (Sequences whose last token is in flight are not stuck: the next update ends them.)
            self._preempt(running.pick_victim(), step)
            budget = self._admission.swap_in(step, budget)
            if not self._swapped:
                self._admission.admit_waiting(step, budget)
        sampling, num_samplers = step.count_computed(self._running)
        # frees, clones and appended tokens ride on a plan that runs; an empty plan is not sent
        freed: list[int] = []
        clones: list[tuple[int, int]] = []
        appends: list[tuple[int, int]] = []
        if step.scheduled:
            freed, self._freed_seq_ids = self._freed_seq_ids, []
            clones, appends = self._beam_search.take_ops()
        plan = step.plan(self._next_step_id, sampling[:num_samplers], freed, clones, appends)
        if not plan.is_noop:  # sent, so answered: a plan that only swaps is in flight too (sampling nothing)
            self._sampling[plan.step_id] = sampling
        if step.scheduled:
            self._spec.planned(plan.step_id, step.draft_slots)
            if all(n == 1 for _, n in step.scheduled):
                self._decode_only_steps.add(plan.step_id)
        self._next_step_id += 1
        return plan

    def _has_queued(self) -> bool:
        """Whether a sequence waits or is swapped out (dropping queue heads that were aborted)."""
        return self._waiting.head() is not None or self._swapped.head() is not None

    def _preempt(self, seq: Sequence, step: Step) -> None:
        """`seq`, just taken off the run queue, gives way: swapped out or freed for recompute."""
        step.preempted = True
        self.metrics.preemptions_total += 1
        if self._preemption.swaps(seq) and self.block_manager.can_swap_out(seq.seq_id):
            step.swap_out += self.block_manager.swap_out(seq.seq_id)
            seq.status = SeqStatus.SWAPPED
            self._swapped.push(seq)
            self.metrics.swap_outs_total += 1
        else:
            self._free(seq)
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            if seq.candidates is None:
                self._waiting.push(seq)
            # else: a beam that already reported waits outside the queue until its search selects
        self._running.left(seq)
        self._waiting.touch(seq.request)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FORK_PENDING:  # never started: its parent forgets it
            parent = seq.request.seqs[0]
            parent.fork_children.remove(seq)
            if parent.status is SeqStatus.RUNNING:
                self._running.release_fork_seats(1)
        elif seq.fork_children:  # aborted before its prompt was done: the next child takes its place
            if seq.status is SeqStatus.RUNNING:
                self._running.release_fork_seats(len(seq.fork_children))
            heir, *rest = seq.fork_children
            seq.fork_children = []
            heir.fork_children = rest
            heir.status = SeqStatus.WAITING
            heir.token_ids = list(heir.token_ids)  # it shared the request's prompt list
            self._waiting.push(heir)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq.request.beam is not None:
            seq.request.live_beams.remove(seq)
            self._running.rebalance_beam_seats(seq.request)
        self._free(seq)
        del self._seqs[seq.seq_id]
        request = seq.request
        self._waiting.touch(request)
        if request.finished:
            del self._requests[request.key]
            self.metrics.observe_finished(request, reason, self._clock())

    def update(self, step: StepOutput) -> list[Output]:
        """Appends the sampled tokens, ends finished sequences and returns what to send to clients. Every
        token goes out in the update that brings it, so an output carries exactly one new token. The output
        must have passed `check_output`. A sequence aborted or finished since the step was planned is
        skipped; a request whose handling fails is ended with an error (take_errors), the others go on."""
        now = self._clock()
        self._sampling.pop(step.step_id, None)
        if (tiers := tiers_of(self.block_manager)) is not None:  # its disk reads landed, or failed
            tiers.confirm(step.step_id, step.failed_disk_reads)
        decode_only = step.step_id in self._decode_only_steps
        self._decode_only_steps.discard(step.step_id)
        self.metrics.observe_step(step.gpu_time_s, step.gpu_idle_before_s, decode_only)
        outputs: list[Output] = prompt_logprob_outputs(step, self._seqs)  # before any token of theirs
        any_finished = False
        generated = 0
        live = self._seqs.get  # (bound once: the loop runs once per sampled token)
        for seq in filter(None, map(live, step.failed_seq_ids)):  # first: their EOS must not end them
            self._faults.fail_request(seq.request, CONSTRAINT_FAILED, kind=ErrorKind.INVALID_REQUEST)
        for seq_id, token, logprobs, run in self._spec.runs(step):  # run: a drafting sequence's other tokens
            seq = live(seq_id)
            if seq is None:
                continue  # finished (aborted, or stopped by a token of an earlier step) while in flight
            try:
                if seq.request.beam is not None:
                    any_finished |= self._beam_search.take_report(seq, logprobs, outputs, now)
                    continue
                any_finished |= self._take_token(seq, token, logprobs, outputs, now)
                generated += 1
                if run is not None:
                    any_finished |= self._spec.take_rest(seq, run, self._take_token, outputs, now)
            except Exception:
                self._faults.fail_request(
                    seq.request, "internal error while handling the request", exc_info=True
                )
                any_finished = True
        self.metrics.generated_tokens_total += generated
        if any_finished:
            self._running.prune()
        return outputs

    def _take_token(
        self, seq: Sequence, token: int, logprobs: TokenLogprobs | None, outputs: list[Output], now: float
    ) -> bool:
        """A sampled token, streamed at once; returns whether the sequence ended."""
        # Running, or preempted after this step was sent: the token is the one it would produce anyway.
        if seq.num_pending_tokens <= 0:
            raise RuntimeError(f"unexpected token for seq {seq.seq_id}")
        seq.num_pending_tokens -= 1
        seq.token_ids.append(token)
        if seq.last_token_time is None:
            self.metrics.observe_token(seq, now)
        else:
            self.metrics.observe_interval(now - seq.last_token_time)
            seq.last_token_time = now
        request = seq.request
        ended = False
        if token in request.stop_ids:
            self._finish(seq, FinishReason.STOP)
            ended = True
        elif len(seq.token_ids) >= request.max_total_len:
            self._finish(seq, FinishReason.LENGTH)
            ended = True
        num_cached_tokens = seq.num_cached_tokens if seq.num_cached_tokens > 0 else 0
        token_logprobs = None if request.params.logprobs is None else [logprobs]
        out = SeqOutput(
            request.request_id, seq.index, [token], token_logprobs, seq.finish_reason,
            len(request.prompt_token_ids), num_cached_tokens,
        )  # fmt: skip
        outputs.append((request.owner, out))
        return ended

    _output_of = staticmethod(seq_output)  # an aborted sequence's last output (the fault tests break it)
