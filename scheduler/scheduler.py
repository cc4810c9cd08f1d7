"""The scheduler's core: pure and synchronous, no sockets, no asyncio, no torch.

`schedule()` makes the next step's plan and `update(step_output)` turns the worker's sampled tokens into
client outputs. Each step has one token budget (`max_num_batched_tokens`). It goes first to the running
sequences that decode (one token each), then to running unfinished prefills (the rest of the prompt or what
the budget allows: chunked prefill), then to swapped-out sequences coming back, then to waiting sequences,
each group in queue order. When the pool has no block for a running sequence, the last running sequence in
queue order that the step has not scheduled (the newest, or under the priority policy the least urgent) is
preempted: swapped to the CPU pool, or freed and later recomputed, whichever `preemption_mode` says. A
sequence's randomness depends only on its seed and the position, so either way it resumes with exactly the
tokens it would have produced.

Plans may run ahead of the tokens (async scheduling): the server sends plan N+1 while the worker runs plan
N, so `schedule()` is called before `update()` has brought step N's tokens. A sequence that samples in a
plan counts that token as pending; the next plan may schedule it (the worker appended it itself), unless the
pending token is the sequence's last by length. A stop token found in `update()` ends the sequence then: the
plan already sent computes one token too many, whose result is ignored, and the sequence's blocks go back to
the pool for plans after it. A sequence preempted with a token pending gets it all the same (it is the
token the sequence would produce anyway), and waits in its queue until it has.

n > 1: sequence 0 prefills the prompt; the others are forked from it in the step its prefill completes,
sharing its blocks, and sample their first token from its logits. Beam search: each beam reports its top
candidates instead of sampling; once every live beam of a request has reported, `scheduler/beam.py` picks the
next beams, which the worker makes by cloning (sharing blocks), appending tokens and freeing.
"""

from __future__ import annotations

import bisect
import heapq
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import structlog

from common.messages import (
    ErrorKind,
    FinishReason,
    Fork,
    NewSequence,
    RequestError,
    SamplingParams,
    SeqOutput,
    StepOutput,
    StepPlan,
    SubmitRequest,
    TokenLogprobs,
)
from scheduler.beam import BeamGroup
from scheduler.block_manager import Allocation, BlockManager
from scheduler.inspection import SchedulerInspection
from scheduler.metrics import SchedulerMetrics
from scheduler.output_check import check_step_output
from scheduler.request import Request, SeqStatus, Sequence
from scheduler.search import BeamSearchSteps
from scheduler.waiting import WaitingQueue

log = structlog.get_logger(process="scheduler")

Output = tuple[bytes, SeqOutput]  # (owner, output)
Error = tuple[bytes, RequestError]  # (owner, error)

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) over distinct seeds
# Under preemption_mode "auto", a victim with at least this many computed tokens is swapped: recomputing
# its KV would cost more than copying it over PCIe and back.
SWAP_MIN_TOKENS = 256


def _num_seqs(params: SamplingParams) -> int:
    """The sequences a request comes to have at once: n, or a beam search's width."""
    return params.beam_width or params.n


@dataclass(frozen=True)
class SchedulerSettings:
    """What the worker announced, narrowed by the scheduler's own config."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"  # recompute | swap | auto
    scheduling_policy: str = "fcfs"  # fcfs | priority
    kv_policy: str = "paged"  # paged | reserved | reserved-max
    max_waiting_seqs: int = 4096  # sequences queued and not running, at most; beyond it requests get 503
    # while other requests wait, a request's first sequence takes at most this many seats with it (itself
    # and the n > 1 samples forked from its prompt); 0: max_num_seqs // 8
    request_seat_quota: int = 0

    @property
    def watermark_blocks(self) -> int:
        # Admission leaves this many blocks free so running sequences can grow a while before preempting.
        return self.num_kv_blocks // 100

    @property
    def seat_quota(self) -> int:
        return self.request_seat_quota or max(1, self.max_num_seqs // 8)

    @property
    def reserved(self) -> bool:
        """A baseline policy that claims each sequence's whole room at admission."""
        return self.kv_policy != "paged"

    def room(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The KV slots a sequence of such a request may come to hold; what the reserved policies claim at
        admission (reserved-max: max_model_len, as a server that knows nothing of the request's length)."""
        if self.kv_policy == "reserved-max":
            return self.max_model_len
        return min(num_prompt_tokens + max_tokens, self.max_model_len)


@dataclass
class _Step:
    """The plan being built."""

    new_seqs: list[NewSequence] = field(default_factory=list)
    new_block_ids: list[tuple[int, list[int]]] = field(default_factory=list)
    new_block_tables: list[tuple[int, list[int]]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: bool = False


class Scheduler(BeamSearchSteps, SchedulerInspection):
    """Owns the requests, their sequences, the queues and the block manager."""

    def __init__(self, settings: SchedulerSettings, clock: Callable[[], float] = time.monotonic) -> None:
        if settings.max_num_seqs < 1 or settings.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if settings.max_waiting_seqs < 1 or settings.request_seat_quota < 0:
            raise ValueError("max_waiting_seqs must be positive and request_seat_quota not negative")
        self.settings = settings
        self.block_manager = BlockManager(
            settings.num_kv_blocks,
            settings.block_size,
            num_cpu_blocks=settings.num_cpu_blocks if settings.preemption_mode != "recompute" else 0,
            enable_prefix_caching=settings.enable_prefix_caching and not settings.reserved,
        )
        self.metrics = SchedulerMetrics()
        self._clock = clock
        self._requests: dict[tuple[bytes, str], Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._waiting = WaitingQueue()  # fair between requests (scheduler/waiting.py)
        self._swapped: list[tuple[tuple[int, int, int], Sequence]] = []  # heap by sort key
        self._running: list[Sequence] = []  # sorted by sort key: the first preemption victim is last
        self._pending_forks = 0  # fork children of running parents: seats they will take
        self._beam_reserve = 0  # seats beam groups with a running beam hold for their other beams
        self._pending_clones: list[tuple[int, int]] = []  # beam ops for the next plan that runs
        self._pending_appends: list[tuple[int, int]] = []
        self._freed_seq_ids: list[int] = []  # to tell the worker in the next plan
        self._next_seq_id = 0
        self._next_step_id = 0
        self._eos = frozenset(settings.eos_token_ids)
        self._decode_only_steps: set[int] = set()  # plans in flight whose every chunk is one token
        self._sampling: dict[
            int, list[int]
        ] = {}  # step id of a plan in flight -> sequences that sample in it
        self._errors: list[Error] = []  # requests ended by an internal fault, for take_errors()

    # ----------------------------------------------------------------------------------------------------
    # requests in and out

    def add_request(self, owner: bytes, msg: SubmitRequest) -> RequestError | None:
        """Queues the request, or returns why not (nothing of it is kept then): INVALID_REQUEST when it can
        never be served as sent, UNAVAILABLE when `max_waiting_seqs` sequences would be waiting with it
        (retry later), INTERNAL when queueing it failed."""
        try:
            problem = self._validate(owner, msg)
        except Exception as e:  # a field of the wrong type
            problem = f"malformed request ({type(e).__name__})"
        if problem is not None:
            self.metrics.requests_rejected_total += 1
            return RequestError(msg.request_id, ErrorKind.INVALID_REQUEST, problem)
        if self.num_queued_seqs + _num_seqs(msg.params) > self.settings.max_waiting_seqs:
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
        params = request.params
        prompt = request.prompt_token_ids
        eos = frozenset() if params.ignore_eos else self._eos
        request.stop_ids = frozenset(params.stop_token_ids) | eos
        request.max_total_len = min(len(prompt) + params.max_tokens, self.settings.max_model_len)
        base_seed = params.seed if params.seed is not None else random.getrandbits(63)
        priority = request.priority if self.settings.scheduling_policy == "priority" else 0
        order = self._next_seq_id
        if params.beam_width:
            request.beam = BeamGroup(params.beam_width, params.length_penalty)
        for index in range(1 if request.beam else params.n):
            seed = (base_seed * _SEED_MIX + index) % (1 << 63) if index else base_seed % (1 << 63)
            seq_id = self._next_seq_id
            self._next_seq_id += 1
            # a fork child shares the request's prompt list until it is forked (it gets its own list then)
            shared = index > 0 and not self.settings.reserved
            tokens = prompt if shared else list(prompt)
            seq = Sequence(seq_id, request, index, seed, tokens, sort_key=(priority, order, seq_id))
            request.seqs.append(seq)
            if request.beam:
                request.live_beams.append(seq)
            self._seqs[seq_id] = seq
            if not shared:  # reserved mode shares nothing, as pre-paging servers
                self._waiting.push(seq)
            else:
                seq.status = SeqStatus.FORK_PENDING
                request.seqs[0].fork_children.append(seq)
        self._requests[request.key] = request
        self.metrics.prompt_tokens_total += len(prompt)

    def _validate(self, owner: bytes, msg: SubmitRequest) -> str | None:
        if (owner, msg.request_id) in self._requests:
            return f"request id {msg.request_id!r} is already in use"
        problem = msg.params.validate()
        if problem is not None:
            return problem
        if type(msg.priority) is not int or type(msg.cache_salt) is not str:
            return "priority must be an integer and cache_salt a string"
        prompt = msg.prompt_token_ids
        if not prompt:
            return "the prompt is empty"
        vocab = self.settings.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in prompt):
            bad = next(t for t in prompt if type(t) is not int or not 0 <= t < vocab)
            return f"token id {bad!r} is outside the vocabulary [0, {vocab})"
        total = len(prompt) + msg.params.max_tokens
        if total > self.settings.max_model_len:
            return (
                f"this model's maximum context length is {self.settings.max_model_len} tokens, but "
                f"{total} were requested ({len(prompt)} in the prompt, {msg.params.max_tokens} to generate)"
            )
        if _num_seqs(msg.params) > self.settings.max_waiting_seqs:
            return (
                f"this request makes {_num_seqs(msg.params)} sequences; at most "
                f"{self.settings.max_waiting_seqs} may wait in the scheduler"
            )
        room = self.settings.room(len(prompt), msg.params.max_tokens)
        if self.block_manager.blocks_for(room) > self.settings.num_kv_blocks:
            return (
                f"{room} tokens need {self.block_manager.blocks_for(room)} KV blocks, "
                f"more than the whole pool of {self.settings.num_kv_blocks}"
            )
        return None

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
            self._fail_request(request, "internal error while aborting the request", exc_info=True)
            return []

    def _abort(self, request: Request, index: int | None, finish_reason: str) -> list[Output]:
        owner, request_id = request.key
        if request.beam is not None:  # a search is all or nothing: end every beam, report n empty results
            for seq in list(request.live_beams):
                self._finish(seq, finish_reason)
            self._running = [s for s in self._running if s.status is SeqStatus.RUNNING]
            prompt_len = len(request.prompt_token_ids)
            empty = [
                SeqOutput(request_id, i, [], None, finish_reason, prompt_len) for i in range(request.params.n)
            ]
            return [(owner, out) for out in empty]
        outputs = []
        for seq in list(request.seqs):
            if seq.status is SeqStatus.FINISHED or (index is not None and seq.index != index):
                continue
            self._finish(seq, finish_reason)
            outputs.append((owner, self._output_of(seq, [], [])))
        self._running = [s for s in self._running if s.status is SeqStatus.RUNNING]
        return outputs

    def live_requests(self) -> list[tuple[bytes, str]]:
        """(owner, request_id) of every request not yet finished."""
        return list(self._requests)

    def take_errors(self) -> list[Error]:
        """Errors of requests that the core ended because handling them failed (a bug, or a worker's output
        it could not use): each request's sequences are finished and their blocks freed, and its client gets
        one RequestError (INTERNAL) and nothing more. The server sends them after each call of `abort`,
        `update` and `fail_step` (after that call's outputs); the other requests go on."""
        errors, self._errors = self._errors, []
        return errors

    def check_output(self, step: StepOutput) -> str | None:
        """What is wrong with a worker's step output, checked before `update` touches any state: its step is
        one in flight, its lists agree in length, its sequences are exactly those that sample in that step
        (some may have finished or been aborted since), its token ids lie in [0, vocab_size), and the logprobs
        and beam candidates have the shape their requests asked for. None: `update` may take it."""
        sampling = self._sampling.get(step.step_id) if type(step.step_id) is int else None
        return check_step_output(step, sampling, self._seqs, self.settings.vocab_size)

    def fail_step(self, step_id: int) -> StepOutput:
        """For a step in flight whose output `check_output` refused: ends every request with a sequence that
        samples in that step, with an error (take_errors) -- the worker appended their tokens itself, so
        they cannot go on without them -- and returns an empty output that the server passes to `update`
        in the refused one's place, which closes the step."""
        for seq_id in self._sampling.get(step_id, []):
            seq = self._seqs.get(seq_id)
            if seq is not None:
                self._fail_request(seq.request, "the worker's output for this request was malformed")
        return StepOutput(step_id, [], [], [])

    def _fail_request(self, request: Request, message: str, exc_info: bool = False) -> None:
        """Ends every sequence of `request`, frees its blocks and queues an INTERNAL error for its client.
        Works on state that the failure may have left half changed: a sequence that cannot be finished the
        ordinary way is dropped by force, and the seat counts are recounted."""
        log.error("request_failed", request_id=request.request_id, reason=message, exc_info=exc_info)
        self.metrics.requests_failed_total += 1
        for seq in reversed(request.seqs):  # fork children before their parent
            if seq.status is SeqStatus.FINISHED:
                continue
            try:
                self._finish(seq, FinishReason.ABORT)
            except Exception:
                self._drop(seq)
        if self._requests.get(request.key) is request:
            del self._requests[request.key]
        self._running = [s for s in self._running if s.status is SeqStatus.RUNNING]
        self._recount_seats()
        self._errors.append((request.owner, RequestError(request.request_id, ErrorKind.INTERNAL, message)))

    def _drop(self, seq: Sequence) -> None:
        """Forgets a sequence whose ordinary ending failed half way."""
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = FinishReason.ABORT
        seq.fork_children = []
        if seq in seq.request.live_beams:
            seq.request.live_beams.remove(seq)
        self.block_manager.free(seq.seq_id)
        if seq.on_worker:
            self._freed_seq_ids.append(seq.seq_id)
            seq.on_worker = False
        self._seqs.pop(seq.seq_id, None)

    def _recount_seats(self) -> None:
        """Seat counts from the sequences themselves, after a failure may have left them off."""
        self._pending_forks = sum(len(s.fork_children) for s in self._running)
        self._beam_reserve = 0
        for request in {s.request.key: s.request for s in self._seqs.values() if s.request.beam}.values():
            request.beam.seats_held = request.beam.running_beams = 0  # counted afresh, from zero
            self._rebalance_beam_seats(request)

    # ----------------------------------------------------------------------------------------------------
    # one step

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._swapped)

    def schedule(self) -> StepPlan:
        """The next step's plan. Sequences it schedules count their tokens as computed from now on."""
        step = _Step()
        budget = self._schedule_running(step, self.settings.max_num_batched_tokens)
        if not step.preempted:  # right after a preemption, admitting more would only thrash
            budget = self._schedule_swapped(step, budget)
            if not self._swapped:
                self._schedule_waiting(step, budget)
        while not step.scheduled and self._running and self._has_queued() and not self._tokens_in_flight():
            # Everything running is idle: beams waiting for a sibling that cannot get in. Make room for it.
            # (Sequences whose last token is in flight are not stuck: the next update ends them.)
            self._preempt(self._running.pop(), step)
            budget = self._schedule_swapped(step, budget)
            if not self._swapped:
                self._schedule_waiting(step, budget)
        bs = self.settings.block_size
        sampling: list[int] = []  # the scheduled sequences that sample, then their fork children
        num_samplers = 0
        for seq, num_tokens in step.scheduled:
            before = seq.num_computed_tokens
            computed = seq.num_computed_tokens = before + num_tokens
            known = len(seq.token_ids)
            samples = computed == known + seq.num_pending_tokens
            if samples:
                sampling.insert(num_samplers, seq.seq_id)
                num_samplers += 1
                if seq.request.beam is None:
                    seq.num_pending_tokens += 1
                else:  # a beam reports candidates; its next token comes from the search, after the update
                    seq.num_pending_reports += 1
            # A block filled up: cache it, once its tokens are all known (pending ones come with an update).
            if before // bs != computed // bs or computed > known:
                self.block_manager.register_computed(
                    seq.seq_id, seq.token_ids, min(computed, known), seq.request.cache_salt
                )
            if seq.fork_children and samples:
                sampling += [child.seq_id for child in seq.fork_children]
                self._fork_children(seq, step)
        # frees ride on a plan that runs; an empty plan is not sent
        freed = self._freed_seq_ids if step.scheduled else []
        clones = self._pending_clones if step.scheduled else []
        appends = self._pending_appends if step.scheduled else []
        if step.scheduled:
            self._freed_seq_ids, self._pending_clones, self._pending_appends = [], [], []
        plan = StepPlan(
            step_id=self._next_step_id,
            freed_seq_ids=freed,
            new_seqs=step.new_seqs,
            new_block_ids=step.new_block_ids,
            scheduled_seq_ids=[seq.seq_id for seq, _ in step.scheduled],
            num_scheduled_tokens=[n for _, n in step.scheduled],
            sampling_seq_ids=sampling[:num_samplers],
            swap_out=step.swap_out,
            swap_in=step.swap_in,
            new_block_tables=step.new_block_tables,
            block_copies=step.block_copies,
            forks=step.forks,
            clones=clones,
            appended_tokens=appends,
        )
        if step.scheduled:
            self._sampling[plan.step_id] = sampling
            if all(n == 1 for _, n in step.scheduled):
                self._decode_only_steps.add(plan.step_id)
        self._next_step_id += 1
        return plan

    def _schedule_running(self, step: _Step, budget: int) -> int:
        """Decodes first, in queue order; then the rest of the budget to unfinished prefills, in queue order,
        so a long prompt is split over steps and never stalls the sequences already generating."""
        # The hot loop: one pass over every running sequence each step, so it avoids helper calls.
        allocate = self.block_manager.allocate_slots
        reserved = self.settings.reserved
        scheduled = step.scheduled
        running = self._running
        prefills: list[Sequence] = []
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            i += 1
            pending = seq.num_pending_tokens
            num_tokens = len(seq.token_ids) + pending - seq.num_computed_tokens
            if num_tokens != 1:
                if num_tokens:  # (0: a beam waiting for its search to select)
                    prefills.append(seq)
                continue
            if pending and len(seq.token_ids) + pending >= seq.request.max_total_len:
                continue  # the token in flight is its last
            reserve = self._reserve_tokens(seq) if reserved else 0
            allocation = allocate(seq.seq_id, seq.num_computed_tokens, 1, reserve)
            while allocation is None:
                victim = running.pop()  # nothing after seq is scheduled yet: the last one is free to go
                self._preempt(victim, step)
                if victim is seq:
                    break
                allocation = self._allocate(seq, 1)
            if allocation is None:
                break  # seq itself was the last in the queue and is now preempted
            if allocation.new_blocks or allocation.copies:
                self._record_allocation(seq, allocation, step)
            scheduled.append((seq, 1))
            budget -= 1
        for seq in prefills:
            if budget == 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted to make room for a decode
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            allocation = self._allocate(seq, num_tokens)
            while allocation is None:
                victim = self._last_unscheduled(step)
                self._preempt(victim, step)
                if victim is seq:
                    break
                allocation = self._allocate(seq, num_tokens)
            if allocation is None:
                continue
            self._record_allocation(seq, allocation, step)
            scheduled.append((seq, num_tokens))
            budget -= num_tokens
        return budget

    def _last_unscheduled(self, step: _Step) -> Sequence:
        """Takes the last running sequence in queue order that this step has not scheduled yet."""
        taken = {seq.seq_id for seq, _ in step.scheduled}
        for index in range(len(self._running) - 1, -1, -1):
            if self._running[index].seq_id not in taken:
                return self._running.pop(index)
        raise AssertionError("the sequence asking for room is itself unscheduled")

    def _schedule_swapped(self, step: _Step, budget: int) -> int:
        bm = self.block_manager
        while self._swapped and budget > 0 and self._seats_taken() < self.settings.max_num_seqs:
            seq = self._swapped[0][1]
            if seq.status is not SeqStatus.SWAPPED:  # aborted while swapped out
                heapq.heappop(self._swapped)
                continue
            if seq.num_pending_tokens:
                break  # preempted with a token in flight: it comes back once the token is here (next update)
            # its blocks, one more for its next token, and the watermark for the others
            reserve = self.settings.watermark_blocks if self._running else 0
            if bm.num_blocks_to_swap_in(seq.seq_id) + 1 > bm.num_free_blocks - reserve:
                break
            heapq.heappop(self._swapped)
            step.swap_in += bm.swap_in(seq.seq_id)
            step.new_block_tables.append((seq.seq_id, list(bm.block_table(seq.seq_id))))
            self._set_running(seq)
            self.metrics.swap_ins_total += 1
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            allocation = self._allocate(seq, num_tokens) if num_tokens else None
            if allocation is None:
                continue  # back on the GPU; it runs in a later step (a beam may wait for its siblings)
            self._record_allocation(seq, allocation, step)
            step.scheduled.append((seq, num_tokens))
            budget -= num_tokens
        return budget

    def _schedule_waiting(self, step: _Step, budget: int) -> None:
        bm = self.block_manager
        while budget > 0:
            seq = self._waiting.head()
            if seq is None:
                break
            if seq.num_pending_tokens or seq.num_pending_reports:
                break  # preempted with a token (report) in flight: it is recomputed once that is in
            quota = self.settings.seat_quota
            if len(seq.fork_children) >= quota and self._waiting.others_wait(seq.request):
                self._queue_surplus_children(seq, quota - 1)
            if self._seats_taken() + self._seats_needed(seq) > self.settings.max_num_seqs:
                break
            hits = bm.find_cached_prefix(seq.seq_id, seq.token_ids, seq.request.cache_salt)
            num_computed = len(hits) * self.settings.block_size
            num_tokens = min(len(seq.token_ids) - num_computed, budget)
            reserve = self._reserve_tokens(seq)
            needed = bm.num_blocks_to_admit(hits, max(num_computed + num_tokens, reserve))
            watermark = self.settings.watermark_blocks if self._running else 0
            if needed > bm.num_free_blocks - watermark:
                break  # in queue order: nobody overtakes the head of the queue
            self._waiting.pop(seq)
            bm.allocate_prefix(seq.seq_id, hits)
            allocation = bm.allocate_slots(seq.seq_id, num_computed, num_tokens, reserve)
            assert allocation is not None and not allocation.copies
            seq.num_computed_tokens = num_computed
            self.metrics.prefix_cache_queries_total += len(seq.token_ids)
            self.metrics.prefix_cache_hits_total += num_computed
            if seq.num_cached_tokens < 0:
                seq.num_cached_tokens = num_computed
            self._set_running(seq)
            step.new_seqs.append(self._new_sequence(seq))
            seq.on_worker = True
            step.scheduled.append((seq, num_tokens))
            budget -= num_tokens

    # ----------------------------------------------------------------------------------------------------
    # helpers

    def _queue_surplus_children(self, seq: Sequence, keep: int) -> None:
        """While other requests wait, a request's first sequence takes at most `seat_quota` seats with it:
        the fork children past `keep` wait as sequences of their own (they find the prompt's blocks in the
        prefix cache), admitted in turn with other requests' sequences."""
        surplus = seq.fork_children[keep:]
        del seq.fork_children[keep:]
        for child in surplus:
            child.status = SeqStatus.WAITING
            child.token_ids = list(child.token_ids)  # it shared the request's prompt list
            self._waiting.push(child)

    def _has_queued(self) -> bool:
        """Whether a sequence waits or is swapped out (dropping queue heads that were aborted)."""
        while self._swapped and self._swapped[0][1].status is not SeqStatus.SWAPPED:
            heapq.heappop(self._swapped)
        return self._waiting.head() is not None or bool(self._swapped)

    def _tokens_in_flight(self) -> bool:
        return any(s.num_pending_tokens or s.num_pending_reports for s in self._running)

    def _seats_taken(self) -> int:
        return len(self._running) + self._pending_forks + self._beam_reserve

    def _seats_needed(self, seq: Sequence) -> int:
        """Seats that admitting `seq` takes: itself and the fork children it will have, or for the first
        running beam of a search, the search's whole width."""
        group = seq.request.beam
        if group is not None:
            return 0 if group.seats_held else group.width
        return 1 + len(seq.fork_children)

    def _set_running(self, seq: Sequence) -> None:
        seq.status = SeqStatus.RUNNING
        bisect.insort(self._running, seq, key=lambda s: s.sort_key)
        self._pending_forks += len(seq.fork_children)
        if seq.request.beam is not None:
            self._rebalance_beam_seats(seq.request)

    def _reserve_tokens(self, seq: Sequence) -> int:
        """Reserved policies: the sequence's whole room, claimed at admission; 0 when paged."""
        if not self.settings.reserved:
            return 0
        return self.settings.room(seq.num_prompt_tokens, seq.request.params.max_tokens)

    def _allocate(self, seq: Sequence, num_tokens: int) -> Allocation | None:
        reserve = self._reserve_tokens(seq)
        return self.block_manager.allocate_slots(seq.seq_id, seq.num_computed_tokens, num_tokens, reserve)

    def _record_allocation(self, seq: Sequence, allocation: Allocation, step: _Step) -> None:
        step.block_copies += allocation.copies
        if allocation.replaced:  # a private copy took a shared block's place
            step.new_block_tables.append((seq.seq_id, list(self.block_manager.block_table(seq.seq_id))))
        elif allocation.new_blocks:
            step.new_block_ids.append((seq.seq_id, allocation.new_blocks))

    def _fork_children(self, parent: Sequence, step: _Step) -> None:
        """The children share the parent's blocks and sample from its logits in this step."""
        for child in parent.fork_children:
            self.block_manager.fork(parent.seq_id, child.seq_id)
            child.token_ids = list(parent.token_ids)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.num_pending_tokens = 1  # it samples from the parent's logits in this step
            child.on_worker = True
            step.forks.append(Fork(parent.seq_id, child.seq_id, child.seed))
            child.status = SeqStatus.RUNNING
            bisect.insort(self._running, child, key=lambda s: s.sort_key)
        self._pending_forks -= len(parent.fork_children)
        parent.fork_children = []

    def _new_sequence(self, seq: Sequence) -> NewSequence:
        return NewSequence(
            seq_id=seq.seq_id,
            token_ids=list(seq.token_ids),
            block_table=list(self.block_manager.block_table(seq.seq_id)),
            num_computed_tokens=seq.num_computed_tokens,
            params=seq.request.params,
            seed=seq.seed,
        )

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        step.preempted = True
        self._pending_forks -= len(seq.fork_children)
        self.metrics.preemptions_total += 1
        mode = self.settings.preemption_mode
        swap = mode == "swap" or (mode == "auto" and seq.num_computed_tokens >= SWAP_MIN_TOKENS)
        swap = swap and seq.request.beam is None  # beams are recomputed: a swapped idle beam could block
        if swap and self.block_manager.can_swap_out(seq.seq_id):
            step.swap_out += self.block_manager.swap_out(seq.seq_id)
            seq.status = SeqStatus.SWAPPED
            heapq.heappush(self._swapped, (seq.sort_key, seq))
            self.metrics.swap_outs_total += 1
        else:
            self.block_manager.free(seq.seq_id)
            if seq.on_worker:
                self._freed_seq_ids.append(seq.seq_id)
                seq.on_worker = False
            seq.num_computed_tokens = 0
            seq.status = SeqStatus.WAITING
            if seq.candidates is None:
                self._waiting.push(seq)
            # else: a beam that already reported waits outside the queue until its search selects (_park)
        if seq.request.beam is not None:
            self._rebalance_beam_seats(seq.request)
        self._waiting.touch(seq.request)

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.FORK_PENDING:  # never started: its parent forgets it
            parent = seq.request.seqs[0]
            parent.fork_children.remove(seq)
            if parent.status is SeqStatus.RUNNING:
                self._pending_forks -= 1
        elif seq.fork_children:  # aborted before its prompt was done: the next child takes its place
            if seq.status is SeqStatus.RUNNING:
                self._pending_forks -= len(seq.fork_children)
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
            self._rebalance_beam_seats(seq.request)
        self.block_manager.free(seq.seq_id)
        if seq.on_worker:
            self._freed_seq_ids.append(seq.seq_id)
            seq.on_worker = False
        del self._seqs[seq.seq_id]
        request = seq.request
        self._waiting.touch(request)
        if request.finished:
            del self._requests[request.key]
            self.metrics.requests_finished_total += 1

    def update(self, step: StepOutput) -> list[Output]:
        """Appends the sampled tokens, ends finished sequences and returns what to send to clients. Every
        token goes out in the update that brings it, so an output carries exactly one new token. The output
        must have passed `check_output`. A sequence aborted or finished since the step was planned is
        skipped; a request whose handling fails is ended with an error (take_errors), the others go on."""
        now = self._clock()
        self._sampling.pop(step.step_id, None)
        self._observe_step_time(step, now)
        outputs: list[Output] = []
        any_finished = False
        generated = 0
        for seq_id, token, logprobs in zip(step.seq_ids, step.token_ids, step.logprobs, strict=True):
            seq = self._seqs.get(seq_id)
            if seq is None:
                continue  # finished (aborted, or stopped by a token of an earlier step) while in flight
            try:
                if seq.request.beam is not None:
                    any_finished |= self._take_report(seq, logprobs, outputs, now)
                    continue
                any_finished |= self._take_token(seq, token, logprobs, outputs, now)
                generated += 1
            except Exception:
                self._fail_request(seq.request, "internal error while handling the request", exc_info=True)
                any_finished = True
        self.metrics.generated_tokens_total += generated
        if any_finished:
            self._running = [s for s in self._running if s.status is SeqStatus.RUNNING]
        return outputs

    def _take_report(
        self, seq: Sequence, report: TokenLogprobs | None, outputs: list[Output], now: float
    ) -> bool:
        """A beam's candidates; returns whether a beam ended."""
        seq.num_pending_reports -= 1
        if seq.status is not SeqStatus.RUNNING:  # (a beam preempted since then reports again once recomputed)
            return False
        seq.candidates = report
        return self._advance_search(seq.request, outputs, now)

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
            self._observe_token(seq, now)
        else:
            self.metrics.inter_token_latency.observe(now - seq.last_token_time)
            seq.last_token_time = now
        request = seq.request
        ended = False
        if token in request.stop_ids:
            self._finish(seq, FinishReason.STOP)
            ended = True
        elif len(seq.token_ids) >= request.max_total_len:
            self._finish(seq, FinishReason.LENGTH)
            ended = True
        outputs.append(
            (
                request.owner,
                SeqOutput(
                    request.request_id,
                    seq.index,
                    [token],
                    None if request.params.logprobs is None else [logprobs],
                    seq.finish_reason,
                    len(request.prompt_token_ids),
                    seq.num_cached_tokens if seq.num_cached_tokens > 0 else 0,
                ),
            )
        )
        return ended

    def _observe_step_time(self, step: StepOutput, now: float) -> None:
        """GPU time of every step; for decode-only steps also their span on the GPU's clock, from the end
        of the step before to their own end (a decode-only step always follows another step at once, so
        the GPU's idle time before it is what the host made it wait). On the GPU's clock rather than from
        update to update, since the worker queues a step before it answers the one before."""
        m = self.metrics
        m.steps_total += 1
        m.gpu_seconds_total += step.gpu_time_s
        if step.step_id in self._decode_only_steps:
            self._decode_only_steps.discard(step.step_id)
            m.decode_steps_total += 1
            m.decode_gpu_seconds_total += step.gpu_time_s
            m.decode_step_seconds_total += step.gpu_time_s + step.gpu_idle_before_s

    def _observe_token(self, seq: Sequence, now: float) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.time_to_first_token.observe(now - seq.request.arrival_time)
        else:
            self.metrics.inter_token_latency.observe(now - seq.last_token_time)
        seq.last_token_time = now

    @staticmethod
    def _output_of(seq: Sequence, token_ids: list[int], logprobs: list) -> SeqOutput:
        request = seq.request
        return SeqOutput(
            request.request_id,
            seq.index,
            token_ids,
            logprobs if request.params.logprobs is not None else None,
            seq.finish_reason,
            len(request.prompt_token_ids),
            max(0, seq.num_cached_tokens),
        )
