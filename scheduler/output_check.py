"""What a worker's StepOutput must look like before the scheduler lets it touch any state.

The worker is trusted to run plans, not to be right: a step output that answers no step in flight, names
sequences that did not sample in that step, or carries token ids outside the vocabulary would corrupt the
core (or raise inside it). `check_step_output` says what is wrong, or None; the server drops a bad output.
"""

from __future__ import annotations

import math
from collections.abc import Set
from typing import Any

from pagedserve.common.messages import StepOutput, TokenLogprobs
from pagedserve.common.speculative import MAX_SPECULATIVE_TOKENS
from pagedserve.scheduler.prompt_logprobs import check_prompt_logprobs
from pagedserve.scheduler.request import Sequence


def _is_number(x: Any) -> bool:
    return type(x) in (int, float)


def _token_ok(token: Any, vocab_size: int) -> bool:
    return type(token) is int and 0 <= token < vocab_size


def _run_counts(step: StepOutput, slotted: Set[int]) -> list[int] | str:
    """Tokens per sequence (speculative decoding: 1 + accepted drafts, only where the plan gave draft slots,
    at most 1 + the drafts verified), or what is wrong with the counts."""
    n = len(step.seq_ids)
    if not step.num_tokens and not step.num_drafts:
        return [1] * n
    counts, drafts = step.num_tokens, step.num_drafts
    if not isinstance(counts, list) or not isinstance(drafts, list) or len(counts) != n or len(drafts) != n:
        return f"num_tokens and num_drafts must list one count per sequence ({n})"
    for seq_id, c, d in zip(step.seq_ids, counts, drafts, strict=True):
        if type(c) is not int or type(d) is not int or not 1 <= c <= d + 1 or (d and seq_id not in slotted):
            return f"seq {seq_id}: {c!r} tokens of {d!r} drafts"
        if d > MAX_SPECULATIVE_TOKENS:
            return f"seq {seq_id}: {d} drafts, more than {MAX_SPECULATIVE_TOKENS}"
    return counts


def check_step_output(
    step: StepOutput,
    sampling: list[int] | None,
    seqs: dict[int, Sequence],
    vocab_size: int,
    slotted: Set[int] = frozenset(),
) -> str | None:
    """`sampling`: the sequences that sample in the step `step` answers, None when that step is not in
    flight; `seqs`: the live sequences (one absent was aborted or finished since, and is not looked at);
    `slotted`: those of them that had draft slots."""
    if sampling is None:
        return f"step {step.step_id!r} is not in flight"
    if not all(isinstance(f, list) for f in (step.seq_ids, step.token_ids, step.logprobs)):
        return "seq_ids, token_ids and logprobs must be lists"
    n = len(step.seq_ids)
    counts = _run_counts(step, slotted)
    if isinstance(counts, str):
        return counts
    num_tokens = sum(counts)
    if len(step.token_ids) != num_tokens or len(step.logprobs) != num_tokens:
        return f"{num_tokens} tokens, {len(step.token_ids)} token ids and {len(step.logprobs)} logprobs"
    for x in (step.gpu_time_s, step.gpu_idle_before_s):
        if not _is_number(x) or not math.isfinite(x) or x < 0:
            return f"step times must be finite and not negative, got {x!r}"
    if not all(type(s) is int for s in step.seq_ids):
        return "seq ids must be integers"
    got = set(step.seq_ids)
    if len(got) != n:
        return "a sequence appears twice"
    if got != set(sampling):
        missing, unexpected = sorted(set(sampling) - got)[:5], sorted(got - set(sampling))[:5]
        return f"the sequences differ from those that sample in step {step.step_id}: missing {missing}, " + (
            f"unexpected {unexpected}"
        )
    if not isinstance(step.failed_seq_ids, list) or not set(step.failed_seq_ids) <= got:
        return "failed_seq_ids must be a list of sequences that sampled in the step"
    ids = (
        step.seq_ids
        if num_tokens == n
        else [s for s, c in zip(step.seq_ids, counts, strict=True) for _ in range(c)]
    )
    for seq_id, token, logprobs in zip(ids, step.token_ids, step.logprobs, strict=True):
        if not _token_ok(token, vocab_size):
            return f"seq {seq_id}: token id {token!r} is outside the vocabulary [0, {vocab_size})"
        seq = seqs.get(seq_id)
        if seq is None:
            continue
        params = seq.request.params
        if params.num_logprobs < 0:
            continue  # asked for none: whatever came is dropped unread
        problem = _check_logprobs(logprobs, params.num_logprobs, vocab_size, need_one=params.beam)
        if problem is not None:
            return f"seq {seq_id}: {problem}"
    return check_prompt_logprobs(step, seqs, vocab_size)


def _check_logprobs(lp: Any, k: int, vocab_size: int, need_one: bool) -> str | None:
    """A TokenLogprobs with at most k top tokens (a beam's candidates: at least one, all distinct)."""
    if not isinstance(lp, TokenLogprobs):
        return "logprobs are missing"
    tokens, values = lp.top_token_ids, lp.top_logprobs
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        return "top tokens and top logprobs differ in length"
    if len(tokens) > k or (need_one and not tokens):
        return f"{len(tokens)} top tokens, expected {'1 to ' if need_one else 'at most '}{k}"
    if not all(_token_ok(t, vocab_size) for t in tokens) or (need_one and len(set(tokens)) != len(tokens)):
        return "a top token id is outside the vocabulary or repeated"
    # -inf is a real logprob (a token the model rules out); NaN and +inf are not
    if not all(_is_number(v) and not math.isnan(v) and v != math.inf for v in [lp.logprob, *values]):
        return "a logprob is not a number below +inf"
    return None
