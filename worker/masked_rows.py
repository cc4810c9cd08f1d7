"""Rows of a step whose every token is masked: the request's own token rules (allowed_token_ids, bad_words,
min_tokens' stops) and its grammar's bitmask together leave nothing to draw.

Such a row has no valid token: an argmax returns token 0 and a draw from all -inf logits is NaN, so whatever
comes out breaks the request's constraints. The sampler flags each such row on the device (its largest
processed logit is -inf, or NaN), the flag travels to the host in the step's one copy of the sampled tokens
(no synchronization of its own), and the worker reports the row's sequence in `StepOutput.failed_seq_ids`,
as it does for a grammar that fails to compile: the scheduler ends that request alone with an error
(scheduler/scheduler.py `update`), the token drawn for it is never sent, and the other rows are untouched.

A logit_bias is additive, as vLLM's (-100 makes a token unlikely, not impossible): a row whose every
allowed token is biased by -100 still has finite logits, draws among them, and is not flagged.

Only steps with a grammar bitmask or logits processors pay the one reduction over the rows: without them
no rule masks anything.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class DraftRows(Protocol):
    """Where each drafting sequence's rows lie (worker/spec/verify.py SpecBatch)."""

    offsets: np.ndarray  # [S] each sequence's first row
    counts: np.ndarray  # [S] its rows: 1 + its drafts


def masked_rows(logits: torch.Tensor, masking: bool) -> torch.Tensor | None:
    """[R] bool on the device: the rows of the processed `logits` ([R, V]) with no token left to draw (all
    -inf, or NaN); None when nothing in the step masks tokens (no grammar bitmask, no logits processors)."""
    if not masking:
        return None
    # NaN > -inf is False: a NaN row is flagged with the all -inf ones.
    return ~(logits.amax(dim=-1) > float("-inf"))


def pack_flags(packed: torch.Tensor, masked: torch.Tensor | None) -> torch.Tensor:
    """`packed` (the step's results, flat) with the flag column appended in its dtype, for the one copy."""
    return packed if masked is None else torch.cat([packed, masked.to(packed.dtype)])


def unpack_flags(host: torch.Tensor, num_rows: int, flagged: bool) -> tuple[np.ndarray, list[int]]:
    """The copied values without the flag column, and the rows it flags (`pack_flags` on the host)."""
    values = host.numpy()
    if not flagged:
        return values, []
    return values[:-num_rows], np.flatnonzero(values[-num_rows:]).tolist()


def masked_seq_ids(seq_ids: list[int], rows: list[int], spec: DraftRows | None = None) -> list[int]:
    """The sequences of the flagged `rows`: row i is seq_ids[i], or with drafts (worker/spec/verify.py)
    sequence j's rows start at spec.offsets[j] and the fork children's one row each follow the last of them.
    """
    if not rows:
        return []
    if spec is None:
        return [seq_ids[r] for r in rows]
    num_forks = len(seq_ids) - len(spec.offsets)
    firsts = np.concatenate([spec.offsets, int(spec.counts.sum()) + np.arange(num_forks)])
    index = np.searchsorted(firsts, np.asarray(rows), side="right") - 1
    return list(dict.fromkeys(seq_ids[i] for i in index.tolist()))
