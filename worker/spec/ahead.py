"""Drafting ahead: the draft model proposes a drafting step's next drafts while the scheduler plans that step.

A drafting step is never pipelined (scheduler/speculation.py): the next plan waits for its answer, so after
the worker answers it the GPU idles through the scheduler's turnaround, and then, once the plan is there,
through the draft model's host work (`Speculation.prepare` -> `propose_on_device`) before the verification
is launched. The two need not be in series: the worker appended the accepted tokens itself, so it knows
every token of the step's drafting sequences as soon as it answers. Right after that answer, when nothing
else is in flight and no message waits (worker/server.py `_loop`), `DraftAhead.draft` asks the proposer for
those sequences' next drafts, each with the k it had and its tokens as they now stand; the drafts stay on
the device (worker/spec/device_drafts.py).

At the plan, `DraftAhead.propose` takes the drafts made ahead for the rows they fit: the same sequence (the
very `SeqState`, so a sequence freed and recomputed is proposed again), with the same number of tokens (its
token list only ever grows, so the same tokens), asking for at most the k drafted ahead (the counts are cut
to the plan's k). The other rows are proposed at the plan in a second call; `propose_on_device` settles the
first call's drafts and syncs each row's draft KV with its tokens (their common prefix), so that call is
correct whatever the first one computed. The plan gets one `DeviceDrafts` with a row per plan row, put
together on the device from the two calls' tables by index (no host sync). Drafts ahead that the plan does
not take are dropped, and the blocks of the draft's pool that only they hold go back to it at once
(`drop_drafts`): drafting ahead for a sequence the plan leaves out (no room for its draft slots, preempted)
must not take the draft's blocks from the rows that do draft. The proposer's per-sequence state is freed
as ever, by the plans' `freed_seq_ids`.

Only a proposer that drafts on the device (the draft model) drafts ahead: prompt lookup is cheap on the
host and stays at the plan. Never under tensor parallelism: the followers cannot see whether a message
waits on rank 0's socket, and drafts depend on the batch they are computed in, so rank 0 drafting ahead
while a follower drafts at the plan could verify different drafts on different ranks (`ModelRunner`
checks the world size).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from pagedserve.worker.sequences import SeqState
from pagedserve.worker.spec.device_drafts import DeviceDrafts
from pagedserve.worker.spec.proposer import ProposeRow
from pagedserve.worker.staging import stage

ProposeOnDevice = Callable[[list[ProposeRow]], DeviceDrafts]


def _on_device(proposer: object) -> ProposeOnDevice | None:
    """The proposer's way to draft on the device (the draft model's), None for one that drafts on the host."""
    return getattr(proposer, "propose_on_device", None)


@dataclass(frozen=True)
class _AheadRow:
    """A sequence drafted ahead: what a plan row must match to take its drafts."""

    seq: SeqState  # the worker's state of the sequence when it drafted ahead
    num_tokens: int  # its token count then
    k: int  # the drafts asked for
    call_row: int  # its row of the ahead call's DeviceDrafts


class DraftAhead:
    """The drafts made ahead of the next plan for the last drafting step's sequences (module doc), and
    counters of how the plans used them."""

    def __init__(self) -> None:
        self.enabled = True  # --no-speculative-draft-ahead turns it off (common/config.py)
        self._candidates: list[tuple[ProposeRow, SeqState]] = []  # the last plan's drafting rows
        self._drafts: DeviceDrafts | None = None  # made ahead, not yet taken by a plan
        self._rows: dict[int, _AheadRow] = {}  # seq id -> its row of `_drafts`
        self._ahead_ms = 0.0  # how long the last draft ahead took on the host
        self.stats: dict[str, float] = {}  # the last plan's: for the step trace (worker/step_trace.py)
        self.num_calls = 0  # drafts made ahead (propose calls)
        self.num_rows_taken = 0  # plan rows whose drafts were made ahead
        self.num_rows_proposed = 0  # plan rows proposed at the plan (the ahead drafts did not fit)

    def drop(self, proposer: object | None = None) -> None:
        """Forgets the drafts made ahead and the candidates (a plan without drafts, a reset); with the
        `proposer`, the draft blocks that only the drafts made ahead hold go back to its pool."""
        self._release(proposer, list(self._rows))
        self._candidates = []
        self._drafts = None
        self._rows = {}
        self.stats = {}

    @staticmethod
    def _release(proposer: object | None, seq_ids: list[int]) -> None:
        drop_drafts = getattr(proposer, "drop_drafts", None)
        if drop_drafts is not None and seq_ids:
            drop_drafts(seq_ids)

    def draft(self, proposer: object, live: dict[int, SeqState]) -> list[int]:
        """Drafts ahead for the last plan's drafting rows that are still `live` (the runner's sequences)
        with nothing pending and tokens left to generate; returns the seq ids the proposer was asked about.
        Once per drafting plan: the candidates are used up."""
        candidates = self._candidates
        self.drop(proposer)
        on_device = _on_device(proposer)
        if on_device is None or not self.enabled:
            return []
        rows: list[ProposeRow] = []
        seqs: list[SeqState] = []
        for row, seq in candidates:
            done = len(seq.token_ids) - seq.prompt_len >= seq.params.max_tokens  # the scheduler ends it
            if live.get(row.seq_id) is seq and not seq.pending and not done:
                rows.append(ProposeRow(row.seq_id, seq.token_ids, row.num_tokens))
                seqs.append(seq)
        if not rows:
            return []
        started = time.perf_counter()
        self._drafts = on_device(rows)
        self._ahead_ms = (time.perf_counter() - started) * 1e3
        self._rows = {
            row.seq_id: _AheadRow(seq, len(seq.token_ids), row.num_tokens, i)
            for i, (row, seq) in enumerate(zip(rows, seqs, strict=True))
        }
        self.num_calls += 1
        return [row.seq_id for row in rows]

    def propose(self, proposer: object, rows: list[ProposeRow], seqs: list[SeqState]) -> DeviceDrafts | None:
        """The plan's drafts on the device, one row per row of `rows` (`seqs`: their sequences): those made
        ahead where they fit, the others proposed now; None without a proposer that drafts on the device.
        The rows become the candidates of the next draft ahead."""
        ahead, ahead_rows = self._drafts, self._rows
        self._rows = {}
        self.drop()
        on_device = _on_device(proposer)
        if on_device is None or not rows:
            self._release(proposer, list(ahead_rows))
            return None
        self._candidates = list(zip(rows, seqs, strict=True))
        taken: list[tuple[int, int]] = []  # (plan row, ahead call row)
        rest: list[int] = []
        for i, (row, seq) in enumerate(self._candidates):
            a = ahead_rows.get(row.seq_id)
            if a is not None and ahead is not None and _fits(a, seq, row) and ahead.counts[a.call_row]:
                taken.append((i, a.call_row))  # (a row with no drafts ahead was catching up: again now)
            else:
                rest.append(i)
        taken_ids = {rows[i].seq_id for i, _ in taken}
        self._release(proposer, [seq_id for seq_id in ahead_rows if seq_id not in taken_ids])
        fresh = on_device([rows[i] for i in rest]) if rest else None
        counts = [0] * len(rows)
        for i, r in taken:
            counts[i] = min(ahead.counts[r], rows[i].num_tokens)  # type: ignore[union-attr]
        for j, i in enumerate(rest):
            counts[i] = fresh.counts[j]  # type: ignore[union-attr]
        self.num_rows_taken += len(taken)
        self.num_rows_proposed += len(rest)
        ahead_ms = round(self._ahead_ms, 3) if taken else 0.0
        self.stats = {"ahead_ms": ahead_ms, "ahead_rows": len(taken), "plan_rows": len(rest)}
        return _combine(counts, ahead, taken, fresh, rest)


def _fits(a: _AheadRow, seq: SeqState, row: ProposeRow) -> bool:
    """Whether the drafts made ahead are those the plan row would get: the same sequence with the same
    tokens (a sequence's token list only grows), at most as many drafts asked for."""
    return a.seq is seq and a.num_tokens == len(seq.token_ids) and row.num_tokens <= a.k


def _combine(
    counts: list[int],
    ahead: DeviceDrafts | None,
    taken: list[tuple[int, int]],
    fresh: DeviceDrafts | None,
    rest: list[int],
) -> DeviceDrafts:
    """One DeviceDrafts with `counts` and a row per plan row: plan row i of `taken` from the ahead call's
    row, the rest's from `fresh` in order. Where one call covers the plan in its own row order its table
    serves as it is (its copy to the host already under way)."""
    num_rows = len(counts)
    if not taken:
        assert fresh is not None
        return replace(fresh, counts=counts, _lists=None)
    assert ahead is not None
    if not rest and [r for _, r in taken] == list(range(len(ahead.counts))):
        return replace(ahead, counts=counts, _lists=None)  # the plan's rows are the ahead call's
    parts = [(ahead, [i for i, _ in taken], [r for _, r in taken])]
    if fresh is not None:
        parts.append((fresh, rest, list(range(len(rest)))))
    device = ahead.tokens.device
    width = max(part.tokens.shape[1] for part, _, _ in parts)
    table = torch.zeros((num_rows, width), dtype=torch.int64, device=device)
    for part, plan_rows, call_rows in parts:
        index = np.array([plan_rows, call_rows], dtype=np.int64)
        on_device = stage([index], device)[0]
        table[on_device[0], : part.tokens.shape[1]] = part.tokens[on_device[1]]
    return DeviceDrafts(counts, table).start_copy()
