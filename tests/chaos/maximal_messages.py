"""The largest legitimate messages under given limits: every list at its bound, every string of 4-byte
characters, every number at its widest encoding (for the MAXMSGSIZE tests)."""

from __future__ import annotations

from pagedserve.common.messages import (
    Fork,
    NewSequence,
    PromptLogprobs,
    RequestOutputs,
    SeqOutput,
    StepOutput,
    StepPlan,
    TokenLogprobs,
)
from pagedserve.common.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_LOGIT_BIAS,
    MAX_REASONING_TAG_CHARS,
    SamplingParams,
    StructuredOutput,
)
from pagedserve.common.socket_limits import MAX_PROMPT_TOP, MAX_SAMPLED_TOP, WireLimits
from pagedserve.common.wire_types import (
    MAX_INT32,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
)

WIDE = "\U0001f600"  # 4 bytes in UTF-8
BIG = 2**63 - 1  # a 9-byte msgpack int
TOKEN = MAX_INT32


def maximal_params() -> SamplingParams:
    structured = StructuredOutput(
        "choice",
        WIDE * MAX_GRAMMAR_CHARS,
        tuple(WIDE * (MAX_GRAMMAR_CHARS // MAX_CHOICES) for _ in range(MAX_CHOICES)),
        reasoning_begin=WIDE * MAX_REASONING_TAG_CHARS,
        reasoning_end=WIDE * MAX_REASONING_TAG_CHARS,
    )
    return SamplingParams(
        n=1,
        max_tokens=MAX_INT32,
        temperature=0.123456789,
        seed=BIG,
        stop_token_ids=(TOKEN,) * MAX_STOP_TOKEN_IDS,
        logprobs=20,
        stop=(WIDE * MAX_STOP_STRING_CHARS,) * MAX_STOP_STRINGS,
        structured=structured,
        prompt_logprobs=20,
        presence_penalty=0.123456789,
        logit_bias=tuple((TOKEN - i, -99.123456789) for i in range(MAX_LOGIT_BIAS)),
        bad_words=((TOKEN,) * MAX_BAD_WORD_TOKENS,) * MAX_BAD_WORDS,
        allowed_token_ids=(TOKEN,) * MAX_ALLOWED_TOKEN_IDS,
    )


def _logprobs(k: int) -> TokenLogprobs:
    return TokenLogprobs(-0.123456789, [TOKEN] * k, [-0.123456789] * k)


def _prompt_logprobs(limits: WireLimits) -> PromptLogprobs:
    n = limits.batched_tokens
    return PromptLogprobs(1, [_logprobs(MAX_PROMPT_TOP)] * n, [MAX_INT32 + 1] * n)


def maximal_step_output(limits: WireLimits) -> StepOutput:
    """Every seat samples with 32 candidates, and a fork child of each, plus every draft accepted; the
    step's whole token budget asked prompt logprobs."""
    seqs = limits.seqs
    drafts = limits.draft_budget or 0
    n = 2 * seqs + drafts
    return StepOutput(
        BIG,
        [BIG] * n,
        [TOKEN] * n,
        [_logprobs(MAX_SAMPLED_TOP)] * n,
        1e9,
        1e9,
        [(BIG, _prompt_logprobs(limits))],
        [BIG] * n,
        num_tokens=[17] * n,
        num_drafts=[16] * n,
    )


def maximal_request_outputs(limits: WireLimits) -> RequestOutputs:
    """Every sampled token of a step in an output of its own, every waiting sequence ended, and the step's
    whole token budget of prompt logprobs."""
    rid = WIDE * MAX_REQUEST_ID_CHARS
    sampled = SeqOutput(rid, 127, [TOKEN], [_logprobs(MAX_SAMPLED_TOP)], "length", BIG, BIG)
    ended = SeqOutput(rid, 127, [], None, "abort", BIG, BIG)
    outputs = [sampled] * (2 * limits.seqs + (limits.draft_budget or 0))
    outputs += [ended] * limits.max_waiting_seqs
    outputs.append(SeqOutput(rid, 0, [], None, None, BIG, BIG, _prompt_logprobs(limits)))
    return RequestOutputs(outputs)


def maximal_step_plan(limits: WireLimits) -> StepPlan:
    """Every seat a new sequence with a whole prompt, a whole block table and the largest parameters, and
    every per-sequence list full."""
    seqs, tokens, blocks = limits.seqs, limits.tokens, limits.blocks_per_seq - 1
    params = maximal_params()
    table = [(1 << 24) - 1] * blocks
    new = [NewSequence(BIG, [TOKEN] * tokens, table, BIG, params, BIG, BIG) for _ in range(seqs)]
    ids = [BIG] * seqs
    pairs = [((1 << 24) - 1, (1 << 24) - 1)] * (blocks * seqs)
    return StepPlan(
        BIG,
        ids,
        new,
        [(BIG, table)] * seqs,
        ids,
        ids,
        ids,
        swap_out=pairs,
        swap_in=pairs,
        new_block_tables=[(BIG, table)] * seqs,
        block_copies=pairs,
        forks=[Fork(BIG, BIG, BIG)] * seqs,
        clones=[(BIG, BIG)] * seqs,
        appended_tokens=[(BIG, TOKEN)] * seqs,
        draft_slots=[(BIG, 16)] * seqs,
    )
