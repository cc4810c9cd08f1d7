"""Beam search inside the scheduler: selection rounds, clones that share blocks, and the final results.

A mixin of `Scheduler` (scheduler/scheduler.py), kept apart because only beam search requests use it. Each
beam reports its candidates instead of a token; once every live beam of a request has reported,
`scheduler/beam.py` picks the continuations and these methods turn them into clones (sharing the parent's
blocks), appended tokens and frees for the worker's next plan.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

from common.messages import FinishReason, SeqOutput
from scheduler.beam import Candidate, Hypothesis, select
from scheduler.request import Request, SeqStatus, Sequence

if TYPE_CHECKING:
    from scheduler.scheduler import Output


class BeamSearchSteps:
    """The beam search part of the scheduler; it uses the scheduler's queues and block manager."""

    def _rebalance_beam_seats(self, request: Request) -> None:
        """A search holds `width` seats while any of its beams runs: its running beams and a reserve."""
        group = request.beam
        running = sum(1 for b in request.live_beams if b.status is SeqStatus.RUNNING)
        held = group.width if running else 0
        self._beam_reserve += (held - running) - (group.seats_held - group.running_beams)
        group.seats_held, group.running_beams = held, running

    def _advance_search(self, request: Request, outputs: list[Output], now: float) -> bool:
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
        self._rebalance_beam_seats(request)
        return pruned

    def _clone_beam(self, parent: Sequence, cand: Candidate) -> None:
        request = parent.request
        seq_id = self._next_seq_id
        self._next_seq_id += 1
        child = Sequence(
            seq_id, request, 0, parent.seed, parent.token_ids + [cand.token],
            sort_key=(*parent.sort_key[:2], seq_id), cum_logprob=cand.cum_logprob,
        )  # fmt: skip
        request.seqs.append(child)
        request.live_beams.append(child)
        self._seqs[seq_id] = child
        if parent.status is SeqStatus.RUNNING:  # share its blocks; the worker copies its state
            self.block_manager.fork(parent.seq_id, seq_id)
            child.num_computed_tokens = parent.num_computed_tokens
            child.num_cached_tokens = parent.num_cached_tokens
            child.on_worker = True
            self._pending_clones.append((parent.seq_id, seq_id))
            self._pending_appends.append((seq_id, cand.token))
            child.status = SeqStatus.RUNNING
            bisect.insort(self._running, child, key=lambda s: s.sort_key)
        else:  # the parent's KV is not on the GPU: the child computes its own
            self._waiting.push(child)

    def _extend_beam(self, beam: Sequence, cand: Candidate) -> None:
        if beam.on_worker:
            self._pending_appends.append((beam.seq_id, cand.token))
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
            self.metrics.generated_tokens_total += len(hyp.token_ids)
        self.metrics.time_to_first_token.observe(now - request.arrival_time)
        for beam in list(request.live_beams):
            self._finish(beam, FinishReason.STOP)
