"""What a request asks of generation: `SamplingParams`, one object from the api through the plan to the
sampler (a new sampling parameter is a field here, its parsing in the api, and its use in the sampler)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta

from pagedserve.common.wire_types import (
    MAX_INT32,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    Seed,
    StopString,
    Temperature,
    TokenId,
    TopK,
    TopP,
)

MAX_GRAMMAR_CHARS = 1 << 18  # a JSON schema's text, a regex or a grammar
MAX_REASONING_TAG_CHARS = 64  # <think>, </think> and their kin
MAX_CHOICES = 1024
# Bounds of the logits processors' parameters (worker/logits_processors.py): each entry costs the sampler a
# little work every step, so a request's lists are bounded well above what clients send.
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_BAD_WORDS = 128  # bad_words token sequences (the api tokenizes each word up to two ways)
MAX_BAD_WORD_TOKENS = 32  # tokens in one bad word
MAX_ALLOWED_TOKEN_IDS = 1 << 16
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| and repetition_penalty, as OpenAI's and vLLM's
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias|, as OpenAI's

Penalty = Annotated[float, Meta(ge=-MAX_PENALTY, le=MAX_PENALTY)]
BiasValue = Annotated[float, Meta(ge=-MAX_LOGIT_BIAS_VALUE, le=MAX_LOGIT_BIAS_VALUE)]
BadWord = Annotated[tuple[TokenId, ...], Meta(min_length=1, max_length=MAX_BAD_WORD_TOKENS)]


class StructuredOutput(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on the generated text: the sampler draws only tokens that keep the output valid under it
    (OpenAI's `response_format`, vLLM's `structured_outputs`, tool_choice `required` or a named function)."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] = ""  # the schema's JSON text, regex or grammar
    choices: Annotated[
        tuple[Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)], ...], Meta(max_length=MAX_CHOICES)
    ] = ()
    # JSON kinds: free whitespace between tokens. Off by default: compact JSON (one space after `,` and `:`),
    # as OpenAI's outputs; with it a weak model at temperature 1 can spend all of max_tokens on whitespace
    any_whitespace: bool = False
    # A reasoning model's thinking comes first, unconstrained (vLLM holds structured output off until the
    # reasoning ends): the output is `reasoning_begin`, any text without `reasoning_end`, `reasoning_end`,
    # then what the constraint allows. Empty reasoning_end: the constraint holds from the first token.
    reasoning_begin: Annotated[str, Meta(max_length=MAX_REASONING_TAG_CHARS)] = ""
    reasoning_end: Annotated[str, Meta(max_length=MAX_REASONING_TAG_CHARS)] = ""

    def validate(self) -> str | None:
        """Why this constraint is unusable (the grammar itself is checked by the api, with xgrammar)."""
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            return f"a {self.kind} constraint needs its {self.kind.replace('_', ' ')}"
        if self.kind == "choice" and not self.choices:
            return "a choice constraint needs at least one choice"
        if sum(len(c) for c in self.choices) > MAX_GRAMMAR_CHARS:
            return f"the choices must total at most {MAX_GRAMMAR_CHARS} characters"
        if self.reasoning_begin and not self.reasoning_end:
            return "a reasoning_begin needs its reasoning_end"
        return None


class SamplingParams(msgspec.Struct, frozen=True, array_like=True):
    """What a request asks of generation. Validated by `validate()` in the scheduler, for every client; the
    decoder already refuses a field outside its own range (the `Meta` bounds), `validate()` says why in words
    for parameters built in-process and checks the rules that tie fields together."""

    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1  # independent sequences per prompt
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_INT32)] = 16  # tokens to generate per sequence, at most
    temperature: Temperature = 1.0  # 0 means greedy
    top_p: TopP = 1.0  # nucleus mass kept, in (0, 1]
    top_k: TopK = 0  # keep the k most likely tokens; 0 keeps all
    seed: Seed | None = None  # same seed, same output; None draws one per request
    # generating one of these ends the sequence (it is kept)
    stop_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_STOP_TOKEN_IDS)] = ()
    ignore_eos: bool = False  # keep going past the model's EOS tokens
    # None: no logprobs; k >= 0: sampled token's logprob and the top k
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # stop strings: applied by the client library, which sees text
    stop: Annotated[tuple[StopString, ...], Meta(max_length=MAX_STOP_STRINGS)] = ()
    # 0: sample; W >= n: beam search keeping W beams, returning the n best, at the end
    beam_width: Annotated[int, Meta(ge=0, le=16)] = 0
    # beam search ranks finished beams by sum of logprobs / length ** this
    length_penalty: Annotated[float, Meta(ge=-100.0, le=100.0)] = 1.0
    structured: StructuredOutput | None = None  # None: free text
    # None: none; k >= 0: each prompt token's logprob given the tokens before it (the first has none) and
    # the top k there. Computed during prefill: a request that asks recomputes its prompt (no prefix cache)
    prompt_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    # The client library's text (client/detokenizer.py): keep the stop string (or stop token) that ended
    # the sequence; drop special tokens; put spaces between special tokens (where the tokenizer decodes so)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # OpenAI's: subtracted from a token's logit once if it was generated (presence) or per time (frequency)
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    # vLLM's: a token of the prompt or the output has its logit divided by this if positive, else multiplied
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=MAX_PENALTY)] = 1.0
    # tokens less likely than min_p x the most likely one (after temperature) are dropped; 0: off
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    # EOS and stop_token_ids cannot be drawn before this many tokens are generated (<= max_tokens)
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_INT32)] = 0
    # (token id, bias) pairs, each token at most once: the bias is added to that token's logit
    logit_bias: Annotated[tuple[tuple[TokenId, BiasValue], ...], Meta(max_length=MAX_LOGIT_BIAS)] = ()
    # token sequences never generated: a word's last token is banned where the output ends with the rest
    bad_words: Annotated[tuple[BadWord, ...], Meta(max_length=MAX_BAD_WORDS)] = ()
    # non-empty: every other token is masked out
    allowed_token_ids: Annotated[tuple[TokenId, ...], Meta(max_length=MAX_ALLOWED_TOKEN_IDS)] = ()

    MAX_LOGPROBS: ClassVar[int] = 20
    MAX_BEAM_WIDTH: ClassVar[int] = 16

    @property
    def beam(self) -> bool:  # beam search: a beam reports candidates, the scheduler chooses its tokens
        return self.beam_width > 0

    @property
    def penalized(self) -> bool:
        """Whether the sampler needs this sequence's token history (penalties, multi-token bad words)."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
            or any(len(w) > 1 for w in self.bad_words)
        )

    @property
    def processed(self) -> bool:
        """Whether any logits processor (worker/logits_processors.py) applies to this sequence's logits."""
        return bool(
            self.min_p
            or self.min_tokens
            or self.logit_bias
            or self.bad_words
            or self.allowed_token_ids
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

    @property
    def num_logprobs(self) -> int:
        """Candidates reported per token: -1 none, else the sampled token's logprob and the top k. A beam
        asks for 2 x beam_width, so that W beams always have W unfinished continuations."""
        return 2 * self.beam_width if self.beam_width else -1 if self.logprobs is None else self.logprobs

    def validate(self) -> str | None:
        """Returns why these parameters are unusable, or None when they are fine. Every comparison is
        written so that NaN fails it."""
        if not 1 <= self.n <= MAX_N:
            return f"n must be between 1 and {MAX_N}, got {self.n}"
        if not 1 <= self.max_tokens <= MAX_INT32:
            return f"max_tokens must be between 1 and {MAX_INT32}, got {self.max_tokens}"
        if not 0.0 <= self.temperature <= 100.0:
            return f"temperature must be between 0 and 100, got {self.temperature}"
        if not 0.0 < self.top_p <= 1.0:
            return f"top_p must be in (0, 1], got {self.top_p}"
        if not 0 <= self.top_k <= MAX_INT32:
            return f"top_k must be 0 (off) or positive, at most {MAX_INT32}, got {self.top_k}"
        if self.logprobs is not None and not 0 <= self.logprobs <= self.MAX_LOGPROBS:
            return f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}"
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS:
            return f"prompt_logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.prompt_logprobs}"
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            return f"seed must fit in 64 bits, got {self.seed}"
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            return f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(self.stop_token_ids)}"
        if any(not 0 <= t <= MAX_INT32 for t in self.stop_token_ids):
            return f"stop token ids must be between 0 and {MAX_INT32}"
        if len(self.stop) > MAX_STOP_STRINGS:
            return f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}"
        if any(not s for s in self.stop):
            return "stop strings must not be empty"
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            return f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters"
        if not all(s.isascii() or _encodes(s) for s in self.stop):
            return "stop strings must be valid Unicode (a lone surrogate cannot cross the wire)"
        if not 0 <= self.beam_width <= self.MAX_BEAM_WIDTH:
            return f"beam width must be between 0 and {self.MAX_BEAM_WIDTH}, got {self.beam_width}"
        if not -100.0 <= self.length_penalty <= 100.0:
            return f"length_penalty must be between -100 and 100, got {self.length_penalty}"
        if self.beam_width:
            if not self.n <= self.beam_width:
                limit = self.MAX_BEAM_WIDTH
                return f"beam width must be between n ({self.n}) and {limit}, got {self.beam_width}"
            if self.temperature != 0.0:
                return "temperature must be 0 with beam search"
            if self.logprobs is not None:
                return "logprobs are not available with beam search"
            if self.prompt_logprobs is not None:
                return "prompt_logprobs are not available with beam search"
        if self.structured is not None:
            return _structured_problem(self)
        return self._processors_problem()

    def _processors_problem(self) -> str | None:
        """Why the logits processors' parameters are unusable, or None."""
        for name in ("presence_penalty", "frequency_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                return f"{name} must be between -{MAX_PENALTY} and {MAX_PENALTY}, got {getattr(self, name)}"
        if not 0.0 < self.repetition_penalty <= MAX_PENALTY:
            return f"repetition_penalty must be in (0, {MAX_PENALTY}], got {self.repetition_penalty}"
        if not 0.0 <= self.min_p <= 1.0:
            return f"min_p must be between 0 and 1, got {self.min_p}"
        if not 0 <= self.min_tokens <= self.max_tokens:
            return f"min_tokens must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}"
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            return f"at most {MAX_LOGIT_BIAS} logit_bias entries, got {len(self.logit_bias)}"
        if any(not 0 <= t <= MAX_INT32 for t, _ in self.logit_bias):
            return f"logit_bias token ids must be between 0 and {MAX_INT32}"
        if any(not -MAX_LOGIT_BIAS_VALUE <= b <= MAX_LOGIT_BIAS_VALUE for _, b in self.logit_bias):
            return f"logit_bias values must be between -{MAX_LOGIT_BIAS_VALUE} and {MAX_LOGIT_BIAS_VALUE}"
        if len({t for t, _ in self.logit_bias}) != len(self.logit_bias):
            return "logit_bias names a token more than once"
        if len(self.bad_words) > MAX_BAD_WORDS:
            return f"at most {MAX_BAD_WORDS} bad word token sequences, got {len(self.bad_words)}"
        if any(not 1 <= len(w) <= MAX_BAD_WORD_TOKENS for w in self.bad_words):
            return f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens"
        if any(not 0 <= t <= MAX_INT32 for w in self.bad_words for t in w):
            return f"bad word token ids must be between 0 and {MAX_INT32}"
        if len(self.allowed_token_ids) > MAX_ALLOWED_TOKEN_IDS:
            return f"at most {MAX_ALLOWED_TOKEN_IDS} allowed_token_ids, got {len(self.allowed_token_ids)}"
        if any(not 0 <= t <= MAX_INT32 for t in self.allowed_token_ids):
            return f"allowed_token_ids must be between 0 and {MAX_INT32}"
        if self.beam_width and self.processed:
            # A beam's candidates are the raw distribution's best tokens: a processor would change nothing.
            return "penalties, min_p, min_tokens, logit_bias, bad_words and allowed_token_ids need sampling"
        return None

    def vocab_problem(self, vocab_size: int) -> str | None:
        """Why a token id of these parameters lies outside the model's vocabulary [0, vocab_size), or None
        (the scheduler checks it: the sampler indexes the logits by these ids; stop_token_ids outside it are
        harmless, never drawn, and the sampler skips them)."""
        ids = (
            *(t for t, _ in self.logit_bias),
            *(t for w in self.bad_words for t in w),
            *self.allowed_token_ids,
        )
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        return None if bad is None else f"token id {bad} is outside the vocabulary [0, {vocab_size})"


def _structured_problem(params: SamplingParams) -> str | None:
    """Structured output's rules: beam search keeps no grammar state per beam; no min_tokens. (With
    ignore_eos, the tokens after the grammar completes are EOS tokens, the only ones it allows then.)"""
    assert params.structured is not None
    if params.beam_width:
        return "structured output is not available with beam search"
    if params.min_tokens:
        # Once the grammar is complete only EOS and the stop tokens remain, which min_tokens would ban too,
        # leaving nothing to draw: the constraint decides where the output ends.
        return "min_tokens cannot be combined with structured output (the constraint decides where it ends)"
    return params.structured.validate()


def _encodes(text: str) -> bool:
    """Whether `text` has a UTF-8 form, as msgpack needs (JSON can carry a lone surrogate, UTF-8 cannot)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
