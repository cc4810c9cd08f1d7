"""Verification of draft tokens by the target model, in the worker (docs/speculative.md).

A plan's `draft_slots` name the sequences that may speculate this step and how many drafts each at most (k);
the scheduler has allocated slots for their next 1 + k tokens. The runner asks the proposer for the drafts,
runs each speculating sequence's next input and its d <= k drafts through the target as one query of 1 + d
tokens (the mixed / prefill path), keeps the logits of all 1 + d positions and samples every one of them as
if it were an ordinary step's row at that position: the same parameters and logits processors, the same
uniform number hashed from (seed, position), the same logprobs.

Acceptance ("sample and compare"): row j's token t_j is the target's draw at position P + j given the
sequence extended by drafts 0..j-1. Drafts are accepted while t_j equals draft j; the sequence gains
t_0 .. t_a, where a is the number accepted (t_a, at the first mismatch or after the last draft, is the
correction or bonus token). Because a draft is a point mass, this is exactly rejection sampling: draft x is
accepted with probability p(x) (the probability that the draw equals x), and on rejection the token is a
draw from p conditioned on not being x (p with x removed, renormalized). Every emitted token is the draw
that sampling without speculation would have made at its position, so greedy outputs are identical, and
seeded sampled outputs are identical too (up to the float noise of batching the logits differently), on
every tensor-parallel rank alike.

Sequences whose sampler reads their token history (penalties, multi-token bad words), structured output and
beams never speculate (the scheduler sends no draft slots for them; a worker that gets some anyway proposes
nothing): their processors would need the drafts in that history for rows past the first.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pagedserve.common.messages import StepOutput, StepPlan, TokenLogprobs
from pagedserve.worker.logits_processors import LogitsProcessors
from pagedserve.worker.plan_check import PlanError, PlanLimits
from pagedserve.worker.sampler import MASK64, SamplingTensors
from pagedserve.worker.sequences import BlockTableArray, SeqState
from pagedserve.worker.spec.ahead import DraftAhead
from pagedserve.worker.spec.device_drafts import DeviceDrafts
from pagedserve.worker.spec.proposer import Proposer, ProposeRow
from pagedserve.worker.structured import TokenBitmask


def may_speculate(seq: SeqState) -> bool:
    """Whether a sequence's sampling allows drafts (the scheduler's `scheduler/speculation.py` agrees)."""
    p = seq.params
    return not seq.beam and not p.penalized and p.structured is None


@dataclass
class SpecBatch:
    """One step's speculation: the drafts of its sampling sequences and the logits rows they occupy."""

    num_tokens: list[int]  # per scheduled sequence: the tokens its query computes (1 + drafts when drafting)
    input_seqs: list[SeqState]  # the scheduled sequences, drafting ones as copies with their drafts appended
    drafts: list[list[int]]  # per sampling sequence (the plan's sampling order), [] when it drafts none
    slotted: list[bool]  # per sampling sequence: it had draft slots (its blocks past the accepted go)
    block_size: int
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # logits rows per sampler
    offsets: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # its first row
    # Drafts left on the device by the proposer (`drafts` then holds 0s until `accept`), and per sampler
    # its row of their propose call (-1: no drafts)
    device: DeviceDrafts | None = None
    call_rows: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.counts = np.fromiter((1 + len(d) for d in self.drafts), np.int64, len(self.drafts))
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)[:-1]]).astype(np.int64)

    def logits_rows(self, query_start_loc: np.ndarray, sampling: list[int]) -> np.ndarray:
        """The flat rows of the hidden states to keep: each sampler's last 1 + d query tokens, in order."""
        ends = query_start_loc[1:][sampling].astype(np.int64)  # one past each sampler's last row
        firsts = np.repeat(ends - self.counts, self.counts)
        return firsts + (np.arange(int(self.counts.sum())) - np.repeat(self.offsets, self.counts))

    def parent_rows(self, parents: list[int]) -> list[int]:
        """The logits rows of fork parents given by sampler index (parents draft nothing: one row each)."""
        return [int(self.offsets[i] + self.counts[i] - 1) for i in parents]

    def draft_feed(
        self, feed: tuple[torch.Tensor, torch.Tensor] | None, query_start_loc: np.ndarray, sampling: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's feed (the runner's pending tokens) with the drafts on the device added: a drafting
        sequence's drafts follow its first token in the flat token ids."""
        if self.device is None:
            return feed
        drafting = [i for i, r in enumerate(self.call_rows) if r >= 0]
        firsts = query_start_loc[:-1][sampling][drafting].astype(np.int64) + 1
        flat, ids = self.device.feed([self.call_rows[i] for i in drafting], firsts)
        return (flat, ids) if feed is None else (torch.cat([feed[0], flat]), torch.cat([feed[1], ids]))

    def add_forks(self, num_children: int) -> None:
        """Fork children sample one row each, after the samplers' rows."""
        self.call_rows = self.call_rows + [-1] * num_children if self.call_rows else []
        self.drafts = self.drafts + [[] for _ in range(num_children)]
        self.slotted = self.slotted + [False] * num_children
        self.__post_init__()

    def sampling_tensors(
        self, samplers: list[SeqState], device: torch.device, processors: LogitsProcessors | None
    ) -> SamplingTensors:
        """The sampler's parameters for every row: a drafting sequence's rows are its own at positions
        P .. P + d, so each draws what an ordinary step at that position would. Samplers past the drafts'
        are the step's fork children: one row each."""
        if len(samplers) > len(self.drafts):
            self.add_forks(len(samplers) - len(self.drafts))
        rows = [s for s, c in zip(samplers, self.counts.tolist(), strict=True) for _ in range(c)]
        base = np.fromiter((len(s.token_ids) + s.pending for s in samplers), np.int64, len(samplers))
        position = np.repeat(base, self.counts) + (
            np.arange(len(rows)) - np.repeat(self.offsets, self.counts)
        )
        return SamplingTensors.from_params(
            [s.params for s in rows],
            seed=np.fromiter((s.seed & MASK64 for s in rows), np.uint64, len(rows)),
            position=position,
            device=device,
            processors=processors.prepare(rows, position) if processors is not None else None,
        )

    def expand_bitmask(self, bitmask: TokenBitmask) -> TokenBitmask:
        """A bitmask over the samplers, moved to their rows (constrained sequences draft nothing)."""
        offsets = torch.from_numpy(self.offsets).to(bitmask.rows.device)
        return replace(bitmask, rows=offsets[bitmask.rows])

    def accept(
        self, tokens: list[int], logprobs: list[TokenLogprobs | None]
    ) -> tuple[list[int], list[list[int]], list[list[TokenLogprobs | None]]]:
        """Per sampler: its first token, and all the tokens it emits (the accepted drafts and one more) with
        their logprobs."""
        if self.device is not None:  # the drafts' ids, copied to the host behind the step's work
            host = self.device.host()
            self.drafts = [host[r] if r >= 0 else d for r, d in zip(self.call_rows, self.drafts, strict=True)]
            self.device = None
        firsts, emitted, emitted_logprobs = [], [], []
        for off, drafts in zip(self.offsets.tolist(), self.drafts, strict=True):
            drawn = tokens[off : off + len(drafts) + 1]
            accepted = 0
            while accepted < len(drafts) and drawn[accepted] == drafts[accepted]:
                accepted += 1
            firsts.append(drawn[0])
            emitted.append(drawn[: accepted + 1])
            emitted_logprobs.append(logprobs[off : off + accepted + 1])
        return firsts, emitted, emitted_logprobs

    def apply(
        self,
        samplers: list[SeqState],
        emitted: list[list[int]],
        emitted_logprobs: list[list[TokenLogprobs | None]],
        out: StepOutput,
        tables: BlockTableArray,
    ) -> None:
        """After `received` appended each sampler's first token: the accepted rest joins its sequence (their
        KV, written by this step's forward, now counts as computed), the blocks past its computed tokens leave
        its table (the scheduler releases the same ones: scheduler/speculation.py), and `out` carries every
        emitted token."""
        for seq, tokens, slotted in zip(samplers, emitted, self.slotted, strict=True):
            if len(tokens) > 1:
                seq.token_ids.extend(tokens[1:])
                seq.num_computed_tokens += len(tokens) - 1
            if slotted:
                keep = -(-seq.num_computed_tokens // self.block_size)
                tables.num_blocks[seq.row] = min(int(tables.num_blocks[seq.row]), keep)
        out.token_ids = [t for run in emitted for t in run]
        out.logprobs = [lp for run in emitted_logprobs for lp in run]
        out.num_tokens = [len(run) for run in emitted]
        out.num_drafts = [len(d) for d in self.drafts]


class Speculation:
    """The worker's side of speculative decoding: asks the proposer for drafts, checks the plan's draft
    slots against the sequences, and lays out the verification step (SpecBatch)."""

    def __init__(self, proposer: Proposer, limits: PlanLimits | None, num_speculative_tokens: int) -> None:
        self.proposer = proposer
        self._limits = limits  # set by `with_limits` once the runner's pool is sized
        self.proposer_k = num_speculative_tokens  # announced to the scheduler (WorkerReady)
        self._known: set[int] = set()  # sequences the proposer was asked about and not told to free
        self.ahead = DraftAhead()  # drafts made while the next plan is made (worker/spec/ahead.py)

    def reset(self) -> None:
        """The runner forgot every sequence (a new scheduler): so does the proposer."""
        for seq_id in self._known:
            self.proposer.free(seq_id)
        self._known.clear()
        self.ahead.drop()  # (the proposer forgot everything)

    def draft_ahead(self, live: dict[int, SeqState]) -> None:
        """The last drafting plan's sequences draft their next tokens now, before the next plan
        (worker/spec/ahead.py); `live`: the runner's sequences."""
        self._known.update(self.ahead.draft(self.proposer, live))

    def with_limits(self, limits: PlanLimits) -> Speculation:
        self._limits = limits
        return self

    @property
    def kv_block_bytes(self) -> int:
        """Bytes a proposer with a KV pool of its own (a draft model) takes per block of the target's pool:
        the target's pool is sized with them counted (0 for the n-gram proposer)."""
        return int(getattr(self.proposer, "kv_block_bytes", 0))

    def allocate_kv(self, num_blocks: int) -> None:
        """The proposer's own pool, as many blocks as the target's (it drafts only for the target's
        sequences), allocated once the target's is sized; nothing for a proposer without one."""
        allocate = getattr(self.proposer, "allocate_kv", None)
        if allocate is not None:
            allocate(num_blocks)

    @property
    def limits(self) -> PlanLimits:
        if self._limits is None:
            raise RuntimeError("Speculation.with_limits was not called")
        return self._limits

    def prepare(
        self, plan: StepPlan, seqs: list[SeqState], sampling: list[int], tables: BlockTableArray
    ) -> SpecBatch | None:
        """Drafts for the plan's draft slots (`seqs`: the scheduled sequences after `apply`, not yet computed;
        `sampling`: the batch indices that sample); None when the plan has none. A batch whose proposer found
        no draft still comes back (all rows single): its slotted sequences' spare blocks go after the step.
        Raises PlanError on slots that contradict the sequences."""
        for seq_id in plan.freed_seq_ids:
            if seq_id in self._known:
                self._known.discard(seq_id)
                self.proposer.free(seq_id)
        if not plan.draft_slots:
            self.ahead.drop(self.proposer)
            return None
        batch_of = {plan.scheduled_seq_ids[b]: b for b in sampling}
        slots = {seq_id for seq_id, _ in plan.draft_slots}
        parents = {fork.parent_seq_id for fork in plan.forks}
        if len(slots) != len(plan.draft_slots):
            raise PlanError("a sequence with draft slots twice")
        rows: list[ProposeRow] = []
        batches: list[int] = []
        bs = self.limits.block_size
        for seq_id, k in plan.draft_slots:
            b = batch_of.get(seq_id)
            if b is None or plan.num_scheduled_tokens[b] != 1:
                raise PlanError(f"draft slots for seq {seq_id}, which does not decode one token and sample")
            seq = seqs[b]
            end = seq.num_computed_tokens + 1 + k
            if seq.pending or end > self.limits.max_model_len or end > int(tables.num_blocks[seq.row]) * bs:
                raise PlanError(f"draft slots for seq {seq_id} past its known tokens, blocks or length")
            if k and may_speculate(seq) and seq_id not in parents:  # children sample a parent's one row
                rows.append(ProposeRow(seq_id, seq.token_ids, k))
                batches.append(b)
        self._known.update(row.seq_id for row in rows)
        # drafts left on the device (the draft model's), some of them made ahead (worker/spec/ahead.py)
        device = self.ahead.propose(self.proposer, rows, [seqs[b] for b in batches])
        if device is not None:  # their ids reach the target on the device (`draft_feed`); 0s stand in here
            device.counts = [min(n, row.num_tokens) for n, row in zip(device.counts, rows, strict=True)]
        proposed = self.proposer.propose(rows) if rows and device is None else []
        proposed = [[0] * n for n in device.counts] if device is not None else proposed
        drafts_of: dict[int, list[int]] = {}
        vocab = self.limits.vocab_size
        for row, b, drafts in zip(rows, batches, proposed, strict=True):
            drafts = [int(t) for t in drafts[: row.num_tokens]]
            bad = [i for i, t in enumerate(drafts) if not 0 <= t < vocab]
            drafts = drafts[: bad[0]] if bad else drafts  # a proposer's bad id ends its drafts there
            if drafts:
                drafts_of[b] = drafts
        num_tokens = list(plan.num_scheduled_tokens)
        input_seqs = list(seqs)
        for b, drafts in drafts_of.items():
            num_tokens[b] += len(drafts)
            input_seqs[b] = replace(seqs[b], token_ids=seqs[b].token_ids + drafts)
        drafts = [drafts_of.get(b, []) for b in sampling]
        slotted = [plan.scheduled_seq_ids[b] in slots for b in sampling]
        batch = SpecBatch(num_tokens, input_seqs, drafts, slotted, bs)
        if device is not None:
            call_row = {b: i for i, b in enumerate(batches)}
            batch.device = device
            batch.call_rows = [call_row[b] if b in drafts_of else -1 for b in sampling]
        return batch


def check_draft_slots(plan: StepPlan, spec: Speculation | None) -> str | None:
    """Why the plan's draft slots cannot be honoured whatever the sequences' state (the runner's
    `check_plan`, which refuses a plan whole), or None. Blocks and lengths are checked at launch."""
    if not plan.draft_slots:
        return None
    if spec is None:
        return "draft slots for a worker without --speculative-config"
    ids = [seq_id for seq_id, _ in plan.draft_slots]
    if len(set(ids)) != len(ids):
        return "a sequence with draft slots twice"
    one_token = {s for s, n in zip(plan.scheduled_seq_ids, plan.num_scheduled_tokens, strict=False) if n == 1}
    samplers = set(plan.sampling_seq_ids)
    for seq_id, k in plan.draft_slots:
        if seq_id not in samplers or seq_id not in one_token:
            return f"draft slots for seq {seq_id}, which does not decode one token and sample"
        if k > spec.proposer_k:
            return f"seq {seq_id}: {k} draft slots, more than the worker's {spec.proposer_k}"
    return None


def prepare_drafts(
    spec: Speculation | None,
    plan: StepPlan,
    seqs: list[SeqState],
    sampling: list[int],
    tables: BlockTableArray,
) -> SpecBatch | None:
    """`Speculation.prepare` of the runner's speculation; a plan with draft slots for a worker that does not
    speculate is refused (PlanError)."""
    if spec is None:
        if plan.draft_slots:
            raise PlanError("draft slots for a worker without --speculative-config")
        return None
    return spec.prepare(plan, seqs, sampling, tables)
