"""Prompt scoring: the logprob of each prompt token given the tokens before it, and the top k at its
position (`SamplingParams.prompt_logprobs`), computed during prefill.

A prefill chunk that computes positions [c, c + n) of a sequence holds, at position p, the hidden state that
predicts token p + 1; each position whose next token is still in the prompt scores that token. Only those
rows of the asking sequences are gathered (never the whole batch's logits), and they go through the
lm_head, the log-softmax (float32) and the top-k a bounded number of rows at a time, so a long prompt with
20 alternatives a token costs memory per chunk, not per prompt. Everything stays on the device until one
copy of the step's results to the host, which `PromptScores.wait` reads when the step finishes.

    scores = select_prompt_rows(plan, seqs, query_start_loc, put, pending)   # None: nobody asked
    scores.score(hidden, model.compute_logits, vocab_size)   # or .score(logits, None): rows of logits
    StepOutput(..., prompt_logprobs=take_prompt_scores(pending, step_id))   # scores.wait()
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from pagedserve.common.messages import PromptLogprobs, SamplingParams, StepPlan, TokenLogprobs

# Rows x vocabulary of float32 logits held at once: 64 MiB, whatever the prompt's length.
MAX_SCORED_ELEMENTS = 1 << 24


class ScoredSeq(Protocol):
    """What prompt scoring reads of a worker sequence (worker/sequences.py SeqState)."""

    token_ids: list[int]
    num_computed_tokens: int
    params: SamplingParams
    prompt_len: int


@dataclass
class PromptScores:
    """One step's scored prompt positions: which rows of its hidden states, the tokens they score, and (once
    `score` ran) the results on their way to the host."""

    seq_ids: list[int]  # the scoring sequences, in batch order
    starts: list[int]  # per sequence: the prompt index of its first scored token (>= 1)
    counts: list[int]  # per sequence: how many consecutive tokens it scores
    num_top: list[int]  # per sequence: its k
    rows: torch.Tensor  # [R] int64, on the device: the flat token rows (of hidden states or logits) used
    targets: torch.Tensor  # [R] int64, on the device: the token each row scores
    # logprob [R], rank [R], top ids [R, K], top logprobs [R, K]: on the host, or on their way there
    _host: list[torch.Tensor] = field(default_factory=list)
    _ready: torch.cuda.Event | None = None

    @classmethod
    def select(
        cls,
        seq_ids: Sequence[int],
        seqs: Sequence[ScoredSeq],
        num_tokens: Sequence[int],
        query_start_loc: np.ndarray,
        put: Callable[[np.ndarray], torch.Tensor],
    ) -> PromptScores | None:
        """The rows to score in a step that computes `num_tokens[b]` tokens of `seqs[b]` from its
        num_computed_tokens (call it before they are counted as computed); None when no row scores."""
        chosen: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        num_top: list[int] = []
        rows: list[np.ndarray] = []
        targets: list[list[int]] = []
        for b, seq in enumerate(seqs):
            k = seq.params.prompt_logprobs
            if k is None:
                continue
            start = seq.num_computed_tokens
            end = min(start + num_tokens[b], seq.prompt_len - 1)  # the last prompt position predicts output
            if end <= start:
                continue
            chosen.append(seq_ids[b])
            starts.append(start + 1)
            counts.append(end - start)
            num_top.append(k)
            rows.append(np.arange(end - start, dtype=np.int64) + int(query_start_loc[b]))
            targets.append(seq.token_ids[start + 1 : end + 1])
        if not chosen:
            return None
        flat_targets = np.fromiter((t for ts in targets for t in ts), np.int64, sum(counts))
        return cls(chosen, starts, counts, num_top, put(np.concatenate(rows)), put(flat_targets))

    @torch.inference_mode()
    def score(
        self,
        states: torch.Tensor,
        compute_logits: Callable[[torch.Tensor], torch.Tensor] | None,
        vocab_size: int = 0,
    ) -> None:
        """Queues the scoring of the selected rows of `states` ([T, H] hidden states through
        `compute_logits`, whose rows have `vocab_size` entries, or [T, V] logits when it is None) and the
        copy of the results to the host."""
        width = states.shape[-1] if compute_logits is None else vocab_size
        chunk = max(1, MAX_SCORED_ELEMENTS // max(width, 1))
        k = min(max(self.num_top), width)
        parts = []
        for begin in range(0, int(self.rows.shape[0]), chunk):
            picked = states[self.rows[begin : begin + chunk]]
            logits = picked if compute_logits is None else compute_logits(picked)
            parts.append(self._score_rows(logits, self.targets[begin : begin + chunk], k))
        host = [torch.cat(column) for column in zip(*parts, strict=True)]
        if states.device.type == "cuda":
            self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in host]
            for dst, src in zip(self._host, host, strict=True):
                dst.copy_(src, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = host

    @staticmethod
    def _score_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> tuple[torch.Tensor, ...]:
        """(target logprob [r], its rank [r], top-k ids [r, k], top-k logprobs [r, k]) of logits [r, V]."""
        logprobs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
        target = logprobs.gather(1, targets[:, None])  # [r, 1]
        # Ties count in the token's favour: its rank is 1 + the tokens strictly more likely.
        rank = (logprobs > target).sum(dim=1) + 1
        top_logprobs, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], targets[:, None][:, :0])
        return target[:, 0], rank, top_ids, top_logprobs

    def wait(self) -> list[tuple[int, PromptLogprobs]]:
        """The results, per scoring sequence, once the device is done with them."""
        if self._ready is not None:
            self._ready.synchronize()
        if not self._host:
            return []
        logprob, rank, top_ids, top_logprobs = (t.tolist() for t in self._host)
        out = []
        begin = 0
        for seq_id, start, count, k in zip(self.seq_ids, self.starts, self.counts, self.num_top, strict=True):
            end = begin + count
            entries = [
                TokenLogprobs(logprob[r], top_ids[r][:k], top_logprobs[r][:k]) for r in range(begin, end)
            ]
            out.append((seq_id, PromptLogprobs(start, entries, rank[begin:end])))
            begin = end
        return out


def select_prompt_rows(
    plan: StepPlan,
    seqs: Sequence[ScoredSeq],
    query_start_loc: np.ndarray,
    put: Callable[[np.ndarray], torch.Tensor],
    pending: dict[int, PromptScores],
) -> PromptScores | None:
    """`PromptScores.select` for a plan's scheduled sequences, kept in `pending` under the plan's step id
    until the step finishes (`take_prompt_scores`)."""
    scores = PromptScores.select(
        plan.scheduled_seq_ids, seqs, plan.num_scheduled_tokens, query_start_loc, put
    )
    if scores is not None:
        pending[plan.step_id] = scores
    return scores


def score_prompts(
    scores: PromptScores | None,
    states: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor] | None = None,
    vocab_size: int = 0,
) -> None:
    """`scores.score(...)` when the step scores anything (the runner's one call per forward path)."""
    if scores is not None:
        scores.score(states, compute_logits, vocab_size)


def take_prompt_scores(pending: dict[int, PromptScores], step_id: int) -> list[tuple[int, PromptLogprobs]]:
    """The prompt logprobs of step `step_id` (none when it scored nothing), forgetting them."""
    scores = pending.pop(step_id, None)
    return [] if scores is None else scores.wait()
