"""What every proposer offers the model runner: draft tokens for some sequences, given their tokens.

The runner hands a proposer each speculating sequence's token ids as they stand (the prompt and the outputs
accepted so far, the last one being the token the target processes next). The tokens are the truth: a
proposer that keeps state per sequence (a draft model's KV) compares them with what it has seen and drops
what no longer holds (rejected drafts, a recompute after preemption), so no other call is needed for a
rollback. `free` releases a sequence's state when it finishes or leaves the worker.

Drafts are deterministic (a draft model proposes its greedy tokens): the verifier treats the draft
distribution as a point mass at each proposed token, which keeps rejection sampling exact whatever the
target samples with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class ProposeRow:
    """One sequence to draft for."""

    seq_id: int
    token_ids: Sequence[int]  # prompt + accepted outputs; the last one is the target's next input
    num_tokens: int  # draft at most this many (>= 1)


class Proposer(Protocol):
    """Drafts tokens; fewer than asked (none at all) is always allowed."""

    def propose(self, rows: list[ProposeRow]) -> list[list[int]]:
        """Draft tokens for each row, in order: row i gets at most rows[i].num_tokens ids."""
        ...

    def free(self, seq_id: int) -> None:
        """Forget the sequence (finished, aborted, preempted or swapped out); unknown ids are ignored."""
        ...
