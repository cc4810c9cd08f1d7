"""Speculative decoding, the scheduler's side: who drafts how many tokens, their slots, and the accepted runs
(docs/speculative.md).

A decoding sequence whose tokens are all on the host (none pending) and whose sampling allows it (no beam,
no structured output, no penalties: `worker/spec/verify.py` says why) may get k draft slots: the plan's
`draft_slots`, k more slots allocated after its next token and counted in the step's token budget. The
worker proposes up to k drafts, verifies them and answers 1 + a tokens for the sequence (a accepted). The
update takes them one by one as ordinary tokens (a stop token or max_tokens inside the run ends the sequence
there: the tokens after it are dropped), counts the accepted drafts' KV as computed, releases the blocks past
what the sequence now holds (the worker drops the same ones) and registers the blocks that accepted tokens
filled in the prefix cache: hashes only ever cover tokens that are known.

Pipelining: a plan made while a drafting step is in flight would not know how many tokens the sequences
gained, so `schedule()` makes none (`blocks_planning`): a step that drafts is always followed by its update.
The server plans ahead only while `active` is false, so at high load, or while acceptance is low, the
pipeline runs exactly as without speculation.

Policy (`step_k`): at most `speculative_draft_budget` draft tokens per step, shared by the decoding sequences
(k each while they fit, fewer as the batch grows, none once budget // batch is 0); and a moving average of
the accepted drafts per drafting sequence and step: below `speculative_min_accepted`, speculation pauses
(one step in `speculative_probe_steps` drafts, to measure again).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import repeat

from pagedserve.common.messages import StepOutput, TokenLogprobs
from pagedserve.scheduler.block_manager import BlockManager
from pagedserve.scheduler.metrics import SchedulerMetrics
from pagedserve.scheduler.request import Output, SeqStatus, Sequence
from pagedserve.scheduler.settings import SchedulerSettings

_EWMA = 0.1  # weight of one step in the acceptance average (about the last 10 drafting steps)

Run = list[tuple[int, TokenLogprobs | None]]  # a sequence's tokens after its first, with their logprobs
TakeToken = Callable[[Sequence, int, TokenLogprobs | None, list[Output], float], bool]


def may_speculate(seq: Sequence) -> bool:
    """Whether the sequence's sampling allows drafts (the worker's `worker/spec/verify.py` agrees)."""
    request = seq.request
    p = request.params
    return request.beam is None and not p.penalized and p.structured is None and p.prompt_logprobs is None


class Speculation:
    """The draft policy, the slots of drafting steps in flight, and the accepted runs."""

    def __init__(
        self, settings: SchedulerSettings, block_manager: BlockManager, metrics: SchedulerMetrics
    ) -> None:
        # (reserved KV policies claim every block up front, shared by forks: no room for a draft's writes)
        self.k = 0 if settings.reserved else settings.num_speculative_tokens
        self._budget = settings.speculative_draft_budget
        self._min_accepted = settings.speculative_min_accepted
        self._probe_steps = settings.speculative_probe_steps
        self._block_manager = block_manager
        self._metrics = metrics
        self.accepted_average = float(self.k)  # optimistic until measured
        self._steps_since_draft = 0
        self._in_flight: dict[int, set[int]] = {}  # step id -> its sequences with draft slots

    def step_k(self, num_decoding: int) -> int:
        """Draft slots per sequence for a step with this many decoding sequences (0: none)."""
        if not self.k or not num_decoding:
            return 0
        k = min(self.k, self._budget // num_decoding)
        if k and self.accepted_average < self._min_accepted and self._steps_since_draft < self._probe_steps:
            return 0
        return k

    def active(self, running: list[Sequence]) -> bool:
        """Whether the next step would draft: then the server waits for the step in flight before planning
        (drafts need every token on the host). Only while some running sequence may speculate: a batch of
        structured-output requests, say, keeps the pipeline."""
        return self.step_k(len(running)) > 0 and any(may_speculate(s) for s in running)

    def blocks_planning(self) -> bool:
        """Whether a drafting step is in flight: no plan can be made before its update."""
        return bool(self._in_flight)

    def slots(self, seq: Sequence, k: int, budget: int) -> int:
        """The draft slots `seq` gets in this step (0: none): within its length and the step's budget."""
        if seq.num_pending_tokens or seq.fork_children or not may_speculate(seq):
            return 0  # (a fork parent's children copy its table and sample its first row: no drafts then)
        return max(0, min(k, budget - 1, seq.request.max_total_len - len(seq.token_ids) - 1))

    def slotted(self, step_id: int) -> set[int]:
        """The sequences with draft slots in a step in flight."""
        return self._in_flight.get(step_id, set()) if type(step_id) is int else set()

    def planned(self, step_id: int, draft_slots: list[tuple[int, int]]) -> None:
        if draft_slots:
            self._in_flight[step_id] = {seq_id for seq_id, _ in draft_slots}
            self._steps_since_draft = 0
        else:
            self._steps_since_draft += 1

    def runs(self, step: StepOutput) -> Iterator[tuple[int, int, TokenLogprobs | None, Run | None]]:
        """(seq_id, first token, its logprobs, the rest of its run or None when it had no draft slots) per
        sequence of the output. Checked by `check_step_output`: num_tokens sums to the tokens."""
        slotted = self._in_flight.pop(step.step_id, None)
        if slotted is None:
            return zip(
                step.seq_ids, step.token_ids, step.logprobs, repeat(None, len(step.seq_ids)), strict=True
            )
        return self._split(step, slotted)

    def _split(self, step: StepOutput, slotted: set[int]) -> Iterator:
        counts = step.num_tokens or [1] * len(step.seq_ids)
        start = accepted = drafted = 0
        for seq_id, n in zip(step.seq_ids, counts, strict=True):
            tokens, logprobs = step.token_ids[start : start + n], step.logprobs[start : start + n]
            start += n
            if seq_id in slotted:
                drafted += 1
                accepted += n - 1
                self._metrics.spec_acceptance_length.observe(n - 1)
            yield (
                seq_id,
                tokens[0],
                logprobs[0],
                list(zip(tokens[1:], logprobs[1:], strict=True)) if seq_id in slotted else None,
            )
        self._metrics.spec_draft_tokens_total += sum(step.num_drafts)
        self._metrics.spec_accepted_tokens_total += accepted
        if drafted:
            mean = accepted / drafted
            self.accepted_average += _EWMA * (mean - self.accepted_average)

    def take_rest(
        self, seq: Sequence, run: Run, take_token: TakeToken, outputs: list[Output], now: float
    ) -> bool:
        """After the run's first token: the accepted drafts' KV counts as computed, each further token is
        taken as an ordinary one (the run stops at an end), and the blocks past what the sequence holds are
        released. Returns whether the sequence ended."""
        if seq.status is not SeqStatus.RUNNING:  # ended by its first token (its blocks are freed)
            return False
        for token, logprobs in run:
            seq.num_computed_tokens += 1  # the token before it: an accepted draft, its KV written
            seq.num_pending_tokens += 1
            self._metrics.generated_tokens_total += 1
            if take_token(seq, token, logprobs, outputs, now):
                return True
        manager = self._block_manager
        manager.trim(seq.seq_id, seq.num_computed_tokens)  # the worker drops the same blocks
        computed = min(seq.num_computed_tokens, len(seq.token_ids))
        manager.register_computed(seq.seq_id, seq.token_ids, computed, seq.request.cache_salt)
        return False
