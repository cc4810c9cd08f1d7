"""The scheduler's core: pure and synchronous, no sockets, no asyncio, no torch.

`schedule()` makes the next step's plan and `update(step_output)` turns the worker's sampled tokens into
client outputs. Each step gives one token budget (`max_num_batched_tokens`) first to the running sequences,
oldest first (a decode costs one token, an unfinished prefill the rest of its prompt or what the budget
allows), then to waiting sequences in arrival order. When the pool has no block for a running sequence, the
newest running sequence is preempted by recompute: its blocks are freed and it goes back to the waiting
queue with every token it has, to be prefilled again later. A sequence's randomness depends only on its seed
and the position, so it resumes with exactly the tokens it would have produced.
"""

from __future__ import annotations

import bisect
import heapq
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from common.messages import (
    ErrorKind,
    FinishReason,
    NewSequence,
    RequestError,
    SeqOutput,
    StepOutput,
    StepPlan,
    SubmitRequest,
)
from scheduler.block_manager import BlockManager
from scheduler.metrics import SchedulerMetrics
from scheduler.request import Request, SeqStatus, Sequence

Output = tuple[bytes, SeqOutput]  # (owner, output)

_SEED_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, index) over distinct seeds


@dataclass(frozen=True)
class SchedulerLimits:
    """What the worker announced, narrowed by the scheduler's own config."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_num_seqs: int
    max_num_batched_tokens: int

    @property
    def watermark_blocks(self) -> int:
        # Admission leaves this many blocks free so running sequences can grow a while before preempting.
        return self.num_kv_blocks // 100


class Scheduler:
    """Owns the requests, their sequences, the waiting and running queues and the block manager."""

    def __init__(self, limits: SchedulerLimits, clock: Callable[[], float] = time.monotonic) -> None:
        if limits.max_num_seqs < 1 or limits.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        self.limits = limits
        self.block_manager = BlockManager(limits.num_kv_blocks, limits.block_size)
        self.metrics = SchedulerMetrics()
        self._clock = clock
        self._requests: dict[tuple[bytes, str], Request] = {}
        self._seqs: dict[int, Sequence] = {}
        self._waiting: list[tuple[int, Sequence]] = []  # heap by seq_id, i.e. arrival order
        self._running: list[Sequence] = []  # sorted by seq_id: the newest is last
        self._freed_seq_ids: list[int] = []  # to tell the worker in the next plan
        self._next_seq_id = 0
        self._next_step_id = 0
        self._eos = frozenset(limits.eos_token_ids)

    # ----------------------------------------------------------------------------------------------------
    # requests in and out

    def add_request(self, owner: bytes, msg: SubmitRequest) -> RequestError | None:
        """Queues the request, or returns why it can never be served (nothing is queued then)."""
        problem = self._validate(owner, msg)
        if problem is not None:
            self.metrics.requests_rejected_total += 1
            return RequestError(msg.request_id, ErrorKind.INVALID_REQUEST, problem)
        params = msg.params
        request = Request(owner, msg.request_id, list(msg.prompt_token_ids), params, self._clock())
        base_seed = params.seed if params.seed is not None else random.getrandbits(63)
        for index in range(params.n):
            seed = (base_seed * _SEED_MIX + index) % (1 << 63) if index else base_seed % (1 << 63)
            seq = Sequence(self._next_seq_id, request, index, seed, list(msg.prompt_token_ids))
            self._next_seq_id += 1
            request.seqs.append(seq)
            self._seqs[seq.seq_id] = seq
            heapq.heappush(self._waiting, (seq.seq_id, seq))
        self._requests[request.key] = request
        self.metrics.prompt_tokens_total += len(msg.prompt_token_ids)
        return None

    def _validate(self, owner: bytes, msg: SubmitRequest) -> str | None:
        if (owner, msg.request_id) in self._requests:
            return f"request id {msg.request_id!r} is already in use"
        problem = msg.params.validate()
        if problem is not None:
            return problem
        prompt = msg.prompt_token_ids
        if not prompt:
            return "the prompt is empty"
        vocab = self.limits.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in prompt):
            bad = next(t for t in prompt if type(t) is not int or not 0 <= t < vocab)
            return f"token id {bad!r} is outside the vocabulary [0, {vocab})"
        total = len(prompt) + msg.params.max_tokens
        if total > self.limits.max_model_len:
            return (
                f"this model's maximum context length is {self.limits.max_model_len} tokens, but "
                f"{total} were requested ({len(prompt)} in the prompt, {msg.params.max_tokens} to generate)"
            )
        if self.block_manager.blocks_for(total) > self.limits.num_kv_blocks:
            return (
                f"{total} tokens need {self.block_manager.blocks_for(total)} KV blocks, "
                f"more than the whole pool of {self.limits.num_kv_blocks}"
            )
        return None

    def abort(
        self, owner: bytes, request_id: str, index: int | None = None, finish_reason: str = FinishReason.ABORT
    ) -> list[Output]:
        """Ends one sequence of a request (or all of them); returns their final outputs."""
        request = self._requests.get((owner, request_id))
        if request is None:
            return []
        outputs = []
        for seq in list(request.seqs):
            if seq.status is SeqStatus.FINISHED or (index is not None and seq.index != index):
                continue
            self._finish(seq, finish_reason)
            outputs.append((owner, self._output_of(seq)))
        self._running = [s for s in self._running if s.status is SeqStatus.RUNNING]
        return outputs

    def live_requests(self) -> list[tuple[bytes, str]]:
        """(owner, request_id) of every request not yet finished."""
        return list(self._requests)

    def abort_owner(self, owner: bytes) -> None:
        """Ends every request of a client that went away."""
        for request in [r for r in self._requests.values() if r.owner == owner]:
            self.abort(owner, request.request_id)

    # ----------------------------------------------------------------------------------------------------
    # one step

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def schedule(self) -> StepPlan:
        """The next step's plan. Sequences it schedules count their tokens as computed from now on."""
        budget = self.limits.max_num_batched_tokens
        new_seqs: list[NewSequence] = []
        new_block_ids: list[tuple[int, list[int]]] = []
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False

        i = 0
        while i < len(self._running) and budget > 0:
            seq = self._running[i]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if num_tokens == 0:  # nothing new to compute (cannot happen while steps run one at a time)
                i += 1
                continue
            blocks = self.block_manager.allocate(seq.seq_id, seq.num_computed_tokens + num_tokens)
            while blocks is None:
                victim = self._running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
                blocks = self.block_manager.allocate(seq.seq_id, seq.num_computed_tokens + num_tokens)
            if blocks is None:
                break  # seq itself was the newest and is now waiting
            if blocks:
                new_block_ids.append((seq.seq_id, blocks))
            scheduled.append((seq, num_tokens))
            budget -= num_tokens
            i += 1

        # Admitting right after a preemption would only thrash: wait for a step that frees blocks.
        max_num_seqs = self.limits.max_num_seqs
        while not preempted and self._waiting and budget > 0 and len(self._running) < max_num_seqs:
            seq = self._waiting[0][1]
            if seq.status is SeqStatus.FINISHED:  # aborted while waiting
                heapq.heappop(self._waiting)
                continue
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            missing = self.block_manager.num_missing_blocks(seq.seq_id, num_tokens)
            reserve = self.limits.watermark_blocks if self._running else 0
            if missing > self.block_manager.num_free_blocks - reserve:
                break  # first come, first served: nobody overtakes the head of the queue
            self.block_manager.allocate(seq.seq_id, num_tokens)
            heapq.heappop(self._waiting)
            seq.status = SeqStatus.RUNNING
            bisect.insort(self._running, seq, key=lambda s: s.seq_id)
            new_seqs.append(self._new_sequence(seq))
            seq.on_worker = True
            scheduled.append((seq, num_tokens))
            budget -= num_tokens

        for seq, num_tokens in scheduled:
            seq.num_computed_tokens += num_tokens
        freed, self._freed_seq_ids = (self._freed_seq_ids, []) if scheduled else ([], self._freed_seq_ids)
        plan = StepPlan(
            step_id=self._next_step_id,
            freed_seq_ids=freed,
            new_seqs=new_seqs,
            new_block_ids=new_block_ids,
            scheduled_seq_ids=[seq.seq_id for seq, _ in scheduled],
            num_scheduled_tokens=[n for _, n in scheduled],
        )
        self._next_step_id += 1
        return plan

    def update(self, step: StepOutput) -> list[Output]:
        """Appends the sampled tokens, ends finished sequences and returns what to send to clients."""
        now = self._clock()
        outputs: list[Output] = []
        any_finished = False
        for i, seq_id in enumerate(step.seq_ids):
            seq = self._seqs.get(seq_id)
            if seq is None or seq.status is not SeqStatus.RUNNING:
                continue  # aborted while its step was in flight
            token = step.token_ids[i]
            seq.token_ids.append(token)
            if step.logprobs[i] is not None:
                seq.pending_logprobs.append(step.logprobs[i])
            self._observe_token(seq, now)
            reason = self._finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                any_finished = True
            outputs.append((seq.request.owner, self._output_of(seq)))
        if any_finished:
            self._running = [s for s in self._running if s.status is SeqStatus.RUNNING]
        return outputs

    # ----------------------------------------------------------------------------------------------------
    # helpers

    def _new_sequence(self, seq: Sequence) -> NewSequence:
        params = seq.request.params
        return NewSequence(
            seq_id=seq.seq_id,
            token_ids=list(seq.token_ids),
            block_table=list(self.block_manager.block_table(seq.seq_id)),
            num_computed_tokens=seq.num_computed_tokens,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k,
            seed=seq.seed,
            num_logprobs=-1 if params.logprobs is None else params.logprobs,
        )

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        if seq.on_worker:
            self._freed_seq_ids.append(seq.seq_id)
            seq.on_worker = False
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        heapq.heappush(self._waiting, (seq.seq_id, seq))
        self.metrics.preemptions_total += 1

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.request.params
        if (token in self._eos and not params.ignore_eos) or token in params.stop_token_ids:
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or len(seq.token_ids) >= self.limits.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.block_manager.free(seq.seq_id)
        if seq.on_worker:
            self._freed_seq_ids.append(seq.seq_id)
            seq.on_worker = False
        del self._seqs[seq.seq_id]
        request = seq.request
        if request.finished:
            del self._requests[request.key]
            self.metrics.requests_finished_total += 1

    def _observe_token(self, seq: Sequence, now: float) -> None:
        self.metrics.generated_tokens_total += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.metrics.time_to_first_token.observe(now - seq.request.arrival_time)
        else:
            self.metrics.inter_token_latency.observe(now - seq.last_token_time)
        seq.last_token_time = now

    def _output_of(self, seq: Sequence) -> SeqOutput:
        start = seq.num_prompt_tokens + seq.num_sent_tokens
        new_tokens = seq.token_ids[start:]
        seq.num_sent_tokens += len(new_tokens)
        logprobs = None
        if seq.request.params.logprobs is not None:
            logprobs, seq.pending_logprobs = seq.pending_logprobs, []
        return SeqOutput(
            request_id=seq.request.request_id,
            index=seq.index,
            token_ids=new_tokens,
            logprobs=logprobs,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
        )

    # ----------------------------------------------------------------------------------------------------
    # state for metrics and tests

    @property
    def num_running_seqs(self) -> int:
        return len(self._running)

    @property
    def num_waiting_seqs(self) -> int:
        return sum(1 for _, s in self._waiting if s.status is SeqStatus.WAITING)

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def metrics_text(self) -> str:
        running_requests = len({s.request.key for s in self._running})
        bm = self.block_manager
        gauges = {
            "pagedserve_requests_running": (running_requests, "Requests with a running sequence"),
            "pagedserve_requests_waiting": (len(self._requests) - running_requests, "Requests queued"),
            "pagedserve_kv_blocks_total": (bm.num_blocks, "KV blocks in the pool"),
            "pagedserve_kv_blocks_used": (bm.num_used_blocks, "KV blocks held by live sequences"),
        }
        return self.metrics.render(gauges)

    def check_invariants(self) -> None:
        """Raises AssertionError when the queues, the sequences and the block manager disagree."""
        self.block_manager.check_invariants()
        waiting = [s for _, s in self._waiting if s.status is SeqStatus.WAITING]
        assert len({s.seq_id for s in waiting}) == len(waiting), "a sequence is twice in the waiting queue"
        assert all(s.status is SeqStatus.RUNNING for s in self._running), "a non-running sequence is running"
        ids = [s.seq_id for s in self._running]
        assert ids == sorted(set(ids)), "the running list is not in arrival order"
        assert len(self._running) <= self.limits.max_num_seqs
        live = {s.seq_id for s in waiting} | set(ids)
        assert live == set(self._seqs), "live sequences differ from the queues"
        for seq in self._running:
            slots = len(self.block_manager.block_table(seq.seq_id)) * self.limits.block_size
            assert slots >= seq.num_computed_tokens, f"seq {seq.seq_id} computed past its blocks"
        for seq in waiting:
            assert not self.block_manager.block_table(seq.seq_id), f"waiting seq {seq.seq_id} holds blocks"
