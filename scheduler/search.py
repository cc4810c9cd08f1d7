"""Beam search inside the scheduler: selection rounds, clones that share blocks, and the final results.

Each beam reports its candidates instead of a token; once every live beam of a request has reported,
`scheduler/beam.py` picks the continuations and `BeamSearch` turns them into clones (sharing the parent's
blocks), appended tokens and frees for the worker's next plan. It is handed the queues, the block manager
and the sequence table it works on, and the scheduler's way of ending a sequence.
"""

from __future__ import annotations

from collections.abc import Callable

from pagedserve.common.messages import FinishReason, SeqOutput, TokenLogprobs
from pagedserve.scheduler.beam import Candidate, Hypothesis, select
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.preemption import PreemptionPolicy
from pagedserve.scheduler.queues import RunQueue
from pagedserve.scheduler.request import Output, Request, SeqStatus, Sequence, SequenceTable
from pagedserve.scheduler.waiting import WaitingQueue


class BeamSearch:
    """The searches of beam search requests, and the worker operations their selections make (clones and
    appended tokens), which ride on the next plan that runs (`take_ops`)."""

    def __init__(
        self,
        seqs: SequenceTable,
        running: RunQueue,
        waiting: WaitingQueue,
        block_manager: BlockManager,
        policy: PreemptionPolicy,
        metrics: SchedulerMetrics,
        finish: Callable[[Sequence, str], None],
    ) -> None:
        self._seqs = seqs
        self._running = running
        self._waiting = waiting
        self._block_manager = block_manager
        self._policy = policy
        self._metrics = metrics
        self._finish = finish  # ends a sequence: frees its blocks, takes it off its queues
        self._clones: list[tuple[int, int]] = []  # (parent, child) for the next plan that runs
        self._appends: list[tuple[int, int]] = []  # (seq_id, token)

    def take_ops(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The clones and appended tokens for the plan being sent (one that runs)."""
        ops = self._clones, self._appends
        self._clones, self._appends = [], []
        return ops

    def take_report(
        self, seq: Sequence, report: TokenLogprobs | None, outputs: list[Output], now: float
    ) -> bool:
        """A beam's candidates; returns whether a beam ended."""
        seq.num_pending_reports -= 1
        if seq.status is not SeqStatus.RUNNING:  # (a beam preempted since then reports again once recomputed)
            return False
        seq.candidates = report
        return self.advance(seq.request, outputs, now)

    def abort(self, request: Request, finish_reason: str) -> list[Output]:
        """A search is all or nothing: every beam ends, and the request gets n empty results."""
        for seq in list(request.live_beams):
            self._finish(seq, finish_reason)
        prompt_len = len(request.prompt_token_ids)
        return [
            (request.owner, SeqOutput(request.request_id, i, [], None, finish_reason, prompt_len))
            for i in range(request.params.n)
        ]

    def advance(self, request: Request, outputs: list[Output], now: float) -> bool:
        """Runs one selection once every live beam has reported its candidates; returns whether a beam
        ended. When the search is done, its n best hypotheses go out as the request's outputs."""
        live = request.live_beams
        if any(b.candidates is None for b in live):
            return False
        group = request.beam
        assert group is not None
        prompt_len = len(request.prompt_token_ids)
        beams = [
            (b.token_ids[prompt_len:], b.cum_logprob, b.candidates.top_token_ids, b.candidates.top_logprobs)
            for b in live
        ]
        chosen, done = select(group, beams, request.stop_ids)
        if not done and len(beams[0][0]) + 1 >= request.max_total_len - prompt_len:
            for cand in chosen:  # they reach the length limit: they end here
                group.add_finished(
                    Hypothesis(beams[cand.parent][0] + [cand.token], cand.cum_logprob, "length")
                )
            done = True
        if done:
            self._end_search(request, outputs, now)
            return True
        children: dict[int, list[Candidate]] = {}
        for cand in chosen:
            children.setdefault(cand.parent, []).append(cand)
        pruned = False
        for i, beam in enumerate(list(live)):
            continuations = children.get(i)
            if not continuations:
                self._finish(beam, FinishReason.STOP)  # out of the search; nothing is reported for it
                pruned = True
                continue
            for cand in continuations[1:]:  # clones first: they copy the beam before it grows
                self._clone_beam(beam, cand)
            self._extend_beam(beam, continuations[0])
        self._running.rebalance_beam_seats(request)
        return pruned

    def _clone_beam(self, parent: Sequence, cand: Candidate) -> None:
        request = parent.request
        seq_id = self._seqs.new_seq_id()
        child = Sequence(
            seq_id, request, 0, parent.seed, parent.token_ids + [cand.token],
            sort_key=self._policy.sort_key(request, seq_id), cum_logprob=cand.cum_logprob,
        )  # fmt: skip
        request.seqs.append(child)
        request.live_beams.append(child)
        self._seqs.add(child)
        if parent.status is SeqStatus.RUNNING:  # share its blocks; the worker copies its state
            self._block_manager.fork(parent.seq_id, seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.on_worker = True
            self._clones.append((parent.seq_id, seq_id))
            self._appends.append((seq_id, cand.token))
            self._running.add_forked(child)  # its search holds its seat
        else:  # the parent's KV is not on the GPU: the child computes its own
            self._waiting.push(child)

    def _extend_beam(self, beam: Sequence, cand: Candidate) -> None:
        if beam.on_worker:
            self._appends.append((beam.seq_id, cand.token))
        if beam.status is SeqStatus.WAITING:  # it was preempted after reporting: back into the queue
            self._waiting.push(beam)
        beam.token_ids.append(cand.token)
        beam.cum_logprob = cand.cum_logprob
        beam.candidates = None

    def _end_search(self, request: Request, outputs: list[Output], now: float) -> None:
        group = request.beam
        assert group is not None
        prompt_len = len(request.prompt_token_ids)
        cached = max(0, request.seqs[0].num_cached_tokens)
        for index, hyp in enumerate(group.best(request.params.n, [])):
            out = SeqOutput(
                request.request_id, index, hyp.token_ids, None, hyp.finish_reason, prompt_len, cached
            )
            outputs.append((request.owner, out))
            self._metrics.generated_tokens_total += len(hyp.token_ids)
        self._metrics.time_to_first_token.observe(now - request.arrival_time)
        for beam in list(request.live_beams):
            self._finish(beam, FinishReason.STOP)
