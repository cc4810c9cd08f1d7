"""Beam search: which beams live on after a step, and when a request's search is done.

Pure functions over token ids and log-probabilities; the scheduler turns a selection into forks (clones that
share the parent's KV blocks), appended tokens and frees. The rules follow the usual beam search: every live
beam offers its top 2W next tokens; candidates are ranked by the sum of logprobs; a stop token among the
first W candidates ends a hypothesis, other candidates continue until W beams are chosen; the search is done
when W hypotheses have ended and no live beam can beat the worst of them (its score only falls as it grows),
or when the beams reach their length limit.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens and their summed logprob."""

    token_ids: list[int]
    cum_logprob: float
    finish_reason: str

    def score(self, length_penalty: float) -> float:
        return self.cum_logprob / max(1, len(self.token_ids)) ** length_penalty


@dataclass
class Candidate:
    parent: int  # index of the beam it extends, in the order the beams were given
    token: int
    cum_logprob: float


@dataclass
class BeamGroup:
    """The search state of one request."""

    width: int
    length_penalty: float
    finished: list[Hypothesis] = field(default_factory=list)
    seats_held: int = 0  # scheduler seats this group holds: `width` while any of its beams runs
    running_beams: int = 0  # of its beams, how many run now (the scheduler keeps this)

    def add_finished(self, hyp: Hypothesis) -> None:
        self.finished.append(hyp)
        self.finished.sort(key=lambda h: -h.score(self.length_penalty))
        del self.finished[self.width :]

    def best(self, n: int, live: list[Hypothesis]) -> list[Hypothesis]:
        """The n best of the finished hypotheses and the live beams (ended as they are)."""
        pool = self.finished + live
        return sorted(pool, key=lambda h: -h.score(self.length_penalty))[:n]


def select(
    group: BeamGroup,
    beams: Seq[tuple[list[int], float, list[int], list[float]]],
    stop_ids: frozenset[int],
) -> tuple[list[Candidate], bool]:
    """One step of the search.

    `beams` gives, per live beam: its generated tokens, its summed logprob, and its candidate next tokens
    with their logprobs. Hypotheses that end are added to `group`. Returns the continuations (best first, at
    most `group.width`) and whether the search is done.
    """
    candidates = [
        Candidate(i, token, cum + lp)
        for i, (_, cum, tokens, logprobs) in enumerate(beams)
        for token, lp in zip(tokens, logprobs, strict=True)
    ]
    candidates.sort(key=lambda c: -c.cum_logprob)
    chosen: list[Candidate] = []
    for rank, cand in enumerate(candidates):
        if cand.token in stop_ids:
            if rank < group.width:  # a stop token ranked past the width would not have been kept
                group.add_finished(Hypothesis(beams[cand.parent][0] + [cand.token], cand.cum_logprob, "stop"))
            continue
        chosen.append(cand)
        if len(chosen) == group.width:
            break
    if not chosen:
        return [], True
    length = len(beams[0][0]) + 1  # beams advance together: every continuation has this many tokens
    best_possible = max(c.cum_logprob for c in candidates) / length**group.length_penalty
    full = len(group.finished) >= group.width
    done = full and group.finished[-1].score(group.length_penalty) >= best_possible
    return chosen, done
