"""What a request asks of generation: `SamplingParams`, one object from the api through the plan to the
sampler (a new sampling parameter is a field here, its parsing in the api, and its use in the sampler)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta

from common.wire_types import (
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
MAX_CHOICES = 1024


class StructuredOutput(msgspec.Struct, frozen=True, array_like=True):
    """A constraint on the generated text: the sampler draws only tokens that keep the output valid under it
    (OpenAI's `response_format`, vLLM's `structured_outputs`, tool_choice `required` or a named function)."""

    kind: Literal["json_schema", "json_object", "regex", "choice", "grammar"]
    spec: Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)] = ""  # the schema's JSON text, regex or grammar
    choices: Annotated[
        tuple[Annotated[str, Meta(max_length=MAX_GRAMMAR_CHARS)], ...], Meta(max_length=MAX_CHOICES)
    ] = ()
    # JSON kinds: any whitespace between tokens (False: none, vLLM's disable_any_whitespace)
    any_whitespace: bool = True

    def validate(self) -> str | None:
        """Why this constraint is unusable (the grammar itself is checked by the api, with xgrammar)."""
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            return f"a {self.kind} constraint needs its {self.kind.replace('_', ' ')}"
        if self.kind == "choice" and not self.choices:
            return "a choice constraint needs at least one choice"
        if sum(len(c) for c in self.choices) > MAX_GRAMMAR_CHARS:
            return f"the choices must total at most {MAX_GRAMMAR_CHARS} characters"
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

    MAX_LOGPROBS: ClassVar[int] = 20
    MAX_BEAM_WIDTH: ClassVar[int] = 16

    @property
    def beam(self) -> bool:  # beam search: a beam reports candidates, the scheduler chooses its tokens
        return self.beam_width > 0

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
        if self.structured is not None:
            return _structured_problem(self)
        return None


def _structured_problem(params: SamplingParams) -> str | None:
    """Structured output's rules: beam search keeps no grammar state per beam. (With ignore_eos, the tokens
    after the grammar completes are EOS tokens, the only ones it allows then.)"""
    assert params.structured is not None
    if params.beam_width:
        return "structured output is not available with beam search"
    return params.structured.validate()


def _encodes(text: str) -> bool:
    """Whether `text` has a UTF-8 form, as msgpack needs (JSON can carry a lone surrogate, UTF-8 cannot)."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True
