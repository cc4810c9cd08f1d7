"""Beam search: which beams live on after a step, and when a request's search is done.

Pure functions over token ids and log-probabilities; the scheduler turns a selection into forks (clones that
share the parent's KV blocks), appended tokens and frees. The rules follow the usual beam search: every live
beam offers its top 2W next tokens; candidates are ranked by the sum of logprobs; a stop token among the
first W candidates ends a hypothesis, other candidates continue until W beams are chosen; the search is done
when W hypotheses have ended and no live beam can beat the worst of them (its score only falls as it grows),
or when the beams reach their length limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

# Beyond this, length ** length_penalty (e ** this) would leave the float range and Python's `**` raises.
_MAX_LOG_SCALE = 700.0


def beam_score(cum_logprob: float, length: int, length_penalty: float) -> float:
    """`cum_logprob / length ** length_penalty` for any finite penalty (length at least 1). Where the power
    would leave the float range the score is its limit: 0 (with cum_logprob's sign) when the divisor is
    huge, infinity (with its sign) when it is tiny. Scores keep their order; only hypotheses that are all
    past the limit tie. Inside the range it is exactly the plain expression, so ordinary rankings are
    unchanged."""
    if length <= 1 or cum_logprob == 0.0:
        return cum_logprob
    log_scale = length_penalty * math.log(length)
    if log_scale > _MAX_LOG_SCALE:
        return math.copysign(0.0, cum_logprob)
    if log_scale < -_MAX_LOG_SCALE:
        return math.copysign(math.inf, cum_logprob)
    return cum_logprob / length**length_penalty


@dataclass
class Hypothesis:
    """A finished beam: its generated tokens and their summed logprob."""

    token_ids: list[int]
    cum_logprob: float
    finish_reason: str

    def score(self, length_penalty: float) -> float:
        return beam_score(self.cum_logprob, len(self.token_ids), length_penalty)


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
    best_possible = beam_score(max(c.cum_logprob for c in candidates), length, group.length_penalty)
    full = len(group.finished) >= group.width
    done = full and group.finished[-1].score(group.length_penalty) >= best_possible
    return chosen, done
