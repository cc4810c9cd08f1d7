"""Prompt logprobs on their way from the worker to the client (`SamplingParams.prompt_logprobs`).

The worker scores the prompt tokens that each prefill chunk computes (worker/prompt_logprobs.py) and sends
them in its StepOutput; the scheduler forwards them at once, in their own SeqOutput, so it never holds a
long prompt's worth. A request counts the positions it has sent (`Request.num_prompt_logprobs`): a prompt
computed again (preemption by recompute, or the next sequence taking over an aborted first one's prompt)
scores positions already sent, which are dropped, so each position reaches the client exactly once and in
order. The prefix cache may serve only positions already sent (`cacheable_prefix`): the others must be
computed to be scored.
"""

from __future__ import annotations

import math
from typing import Any

from pagedserve.common.messages import PromptLogprobs, SeqOutput, StepOutput, TokenLogprobs
from pagedserve.scheduler.request import Output, Request, Sequence


def cacheable_prefix(request: Request, hits: list[int], block_size: int) -> list[int]:
    """The prefix-cache `hits` a new sequence of `request` may take: all of them, unless the request asks
    for prompt logprobs, whose unsent positions must be computed (so only blocks before the first of them)."""
    if request.params.prompt_logprobs is None:
        return hits
    # Token t is scored by position t - 1: the first unsent token, num_prompt_logprobs + 1, needs position
    # num_prompt_logprobs computed in this pass.
    return hits[: request.num_prompt_logprobs // block_size]


def prompt_logprob_outputs(step: StepOutput, seqs: dict[int, Sequence]) -> list[Output]:
    """The outputs carrying the step's new prompt logprobs (already-sent positions dropped), in the
    order the worker gave them. The step must have passed `check_prompt_logprobs`."""
    outputs: list[Output] = []
    for seq_id, chunk in step.prompt_logprobs:
        seq = seqs.get(seq_id)
        if seq is None:
            continue  # finished or aborted since the step was planned
        request = seq.request
        sent = request.num_prompt_logprobs
        # Of this chunk's positions, those sent before. A chunk after a gap (no honest worker sends one) goes
        # as it is: the client refuses it, which fails that request alone.
        skip = max(0, sent + 1 - chunk.start)
        entries = chunk.logprobs[skip:]
        if not entries:
            continue
        request.num_prompt_logprobs = chunk.start + len(chunk.logprobs) - 1
        new = PromptLogprobs(chunk.start + skip, entries, chunk.ranks[skip:])
        out = SeqOutput(
            request.request_id, seq.index, [], None, None, len(request.prompt_token_ids),
            max(0, seq.num_cached_tokens), prompt_logprobs=new,
        )  # fmt: skip
        outputs.append((request.owner, out))
    return outputs


def check_prompt_logprobs(step: StepOutput, seqs: dict[int, Sequence], vocab_size: int) -> str | None:
    """What is wrong with the step's prompt logprobs: each names a live sequence (or one gone since) whose
    request asked for them, at most once, with positions inside its prompt, each with the request's k
    alternatives and a rank. (Whether they follow the positions sent is known only in `update`: the steps
    before this one may not be taken yet.)"""
    if not isinstance(step.prompt_logprobs, list):
        return "prompt_logprobs must be a list"
    seen: set[int] = set()
    for item in step.prompt_logprobs:
        if not isinstance(item, tuple | list) or len(item) != 2 or not isinstance(item[1], PromptLogprobs):
            return "prompt_logprobs entries must be (seq id, PromptLogprobs)"
        seq_id, chunk = item
        if type(seq_id) is not int or seq_id in seen:
            return f"prompt logprobs for seq {seq_id!r}: not an id, or twice in one step"
        seen.add(seq_id)
        seq = seqs.get(seq_id)
        if seq is None:
            continue
        problem = _check_chunk(chunk, seq.request, vocab_size)
        if problem is not None:
            return f"seq {seq_id} prompt logprobs: {problem}"
    return None


def _check_chunk(chunk: PromptLogprobs, request: Request, vocab_size: int) -> str | None:
    k = request.params.prompt_logprobs
    if k is None:
        return "the request asked for none"
    entries, ranks, start = chunk.logprobs, chunk.ranks, chunk.start
    if not isinstance(entries, list) or not isinstance(ranks, list) or len(entries) != len(ranks):
        return "logprobs and ranks differ in length"
    if type(start) is not int or start < 1 or start + len(entries) > len(request.prompt_token_ids):
        return "past the end of the prompt"
    if not all(type(r) is int and 1 <= r <= vocab_size for r in ranks):
        return "a rank is outside [1, vocab_size]"
    for lp in entries:
        problem = _check_entry(lp, k, vocab_size)
        if problem is not None:
            return problem
    return None


def _check_entry(lp: Any, k: int, vocab_size: int) -> str | None:
    if not isinstance(lp, TokenLogprobs):
        return "an entry is not a TokenLogprobs"
    tokens, values = lp.top_token_ids, lp.top_logprobs
    if not isinstance(tokens, list) or not isinstance(values, list) or len(tokens) != len(values):
        return "top tokens and top logprobs differ in length"
    if len(tokens) != k or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
        return f"expected {k} top tokens inside the vocabulary"
    # -inf is a real logprob (a token the model rules out); NaN and positive values are not
    if not all(type(v) in (int, float) and not math.isnan(v) and v <= 0.0 for v in [lp.logprob, *values]):
        return "a logprob is not a number at most 0"
    return None
