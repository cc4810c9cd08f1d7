"""What a response shows of its prompts and how it names tokens: completions `echo`, vLLM's `prompt_logprobs`
(prompt scoring, as lm-eval-harness's loglikelihood requests use: `echo: true, logprobs: k, max_tokens: 0`),
`return_tokens_as_token_ids`, and the text options the client library applies
(`include_stop_str_in_output`, `skip_special_tokens`, `spaces_between_special_tokens`).

As in vLLM, `echo` with `logprobs` asks the worker for the prompt's logprobs (`prompt_logprobs` = `logprobs`
unless given), and `echo` with `max_tokens: 0` returns the prompt alone: one token is generated (our
SamplingParams, as vLLM's, need at least one) and left out of the choice. The first prompt token follows
nothing, so its logprob is null.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve.api.errors import invalid
from pagedserve.api.fields import Fields
from pagedserve.api.model import ServedModel
from pagedserve.client import RequestHandle, ScoredPrompt
from pagedserve.common.messages import SamplingParams, TokenLogprobs

MIN_LOGPROB = -9999.0  # JSON has no -Infinity; OpenAI and vLLM report this instead

# The request fields read here, per endpoint (added to api/protocol.py's allowed sets).
TEXT_FIELDS = frozenset(
    {"include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens"}
)
SCORING_FIELDS = TEXT_FIELDS | {"prompt_logprobs", "return_tokens_as_token_ids"}


@dataclass(frozen=True)
class OutputOptions:
    """How one request's response shows its prompts and names its tokens."""

    echo: bool = False  # completions: each choice starts with its prompt (text, and logprobs when asked)
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone, the one generated token left out
    prompt_texts: tuple[str | None, ...] = ()  # per prompt, the text as sent (None: sent as token ids)
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: tokens named "token_id:<id>"


def parse_output_options(
    f: Fields, num_logprobs: int | None, max_tokens: int | None, stream: bool, echo: bool = False
) -> tuple[OutputOptions, dict[str, Any]]:
    """The response options and the SamplingParams fields these requests fields ask for; a value out of its
    range is a 400 naming the field."""
    prompt_logprobs = f.integer("prompt_logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    if prompt_logprobs and stream:  # as vLLM: a stream's chunks have no place for them
        raise invalid("'prompt_logprobs' are not available when 'stream' is true", "prompt_logprobs")
    if prompt_logprobs is None and echo:
        prompt_logprobs = num_logprobs
    sampling = dict(
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=f.boolean("include_stop_str_in_output"),
        skip_special_tokens=f.boolean("skip_special_tokens", True),
        spaces_between_special_tokens=f.boolean("spaces_between_special_tokens", True),
    )
    raw = f.body.get("prompt")
    batch = [raw] if isinstance(raw, str) or _is_ids(raw) else raw if isinstance(raw, list) else []
    options = OutputOptions(
        echo=echo,
        echo_only=echo and max_tokens == 0,
        prompt_texts=tuple(p if isinstance(p, str) else None for p in batch) if echo else (),
        tokens_as_ids=f.boolean("return_tokens_as_token_ids"),
    )
    return options, sampling


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(type(t) is int for t in value)


class Strings(Protocol):
    """Per-token (text, bytes), and the ids of special tokens (client/detokenizer.py TokenStrings)."""

    special_ids: frozenset[int]

    def get(self, token_id: int) -> tuple[str, bytes]: ...


class TokenIdStrings:
    """Tokens named by id, "token_id:<id>", as vLLM's return_tokens_as_token_ids (bytes: that name's)."""

    def __init__(self, strings: Strings) -> None:
        self.special_ids = strings.special_ids

    def get(self, token_id: int) -> tuple[str, bytes]:
        name = f"token_id:{token_id}"
        return name, name.encode()


class PromptEcho:
    """What a response shows of its prompts, per choice (choice `p * n + i` is sequence i of prompt p)."""

    def __init__(self, options: OutputOptions, handles: list[RequestHandle], model: ServedModel) -> None:
        self.options = options
        self.handles = handles
        self.model = model
        self.n = handles[0].params.n if handles else 1
        self.strings: Strings = (
            TokenIdStrings(model.token_strings) if options.tokens_as_ids else model.token_strings
        )

    def _handle(self, choice_index: int) -> RequestHandle:
        return self.handles[choice_index // self.n]

    def scored(self, choice_index: int) -> ScoredPrompt | None:
        return self._handle(choice_index).prompt_logprobs

    def text(self, choice_index: int) -> str:
        """The prompt's text: as sent, or its token ids decoded (special tokens left out, as in outputs)."""
        p = choice_index // self.n
        texts = self.options.prompt_texts
        if p < len(texts) and texts[p] is not None:
            return texts[p]  # type: ignore[return-value]
        return self.model.tokenizer.decode(
            self._handle(choice_index).prompt_token_ids, skip_special_tokens=True
        )

    def tokens(self, choice_index: int, want_logprobs: bool) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The prompt's token ids and, when asked, their logprobs (None for the first)."""
        ids = list(self._handle(choice_index).prompt_token_ids)
        scored = self.scored(choice_index)
        if not want_logprobs or scored is None:
            return ids, []
        # Complete whenever a token has come (the scheduler sends them all first); padded all the same, so
        # that entries never slide against their tokens
        entries: list[TokenLogprobs | None] = [None, *scored.logprobs[: len(ids) - 1]]
        return ids, entries + [None] * (len(ids) - len(entries))

    def prompt_logprobs(self, choice_index: int) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, then {token id: {logprob, rank,
        decoded_token}} for the token itself and the top k at its position; None when not computed."""
        scored = self.scored(choice_index)
        if scored is None:
            return None
        ids = self._handle(choice_index).prompt_token_ids
        out: list[dict[str, dict[str, Any]] | None] = [None]
        for token_id, lp, rank in zip(ids[1:], scored.logprobs, scored.ranks, strict=False):
            entry = {str(token_id): self._logprob(token_id, lp.logprob, rank)}
            for r, (alt_id, alt_lp) in enumerate(zip(lp.top_token_ids, lp.top_logprobs, strict=False), 1):
                entry.setdefault(str(alt_id), self._logprob(alt_id, alt_lp, r))
            out.append(entry)
        return out

    def _logprob(self, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
        return {
            "logprob": max(logprob, MIN_LOGPROB),
            "rank": rank,
            "decoded_token": self.strings.get(token_id)[0],
        }


def echo_choice(
    echo: PromptEcho | None,
    index: int,
    text: str,
    token_ids: list[int],
    logprobs: list[Any],
    want_logprobs: bool,
    first: bool = True,
) -> tuple[str, list[int], list[Any]]:
    """A completions choice's (text, token ids, logprobs) with its prompt in front when `echo` asks (in a
    stream: on the choice's first chunk only); the generated part is left out when max_tokens was 0."""
    if echo is None or not echo.options.echo:
        return text, token_ids, logprobs
    generated = ("", [], []) if echo.options.echo_only else (text, token_ids, list(logprobs))
    if not first:
        return generated
    ids, prompt_logprobs = echo.tokens(index, want_logprobs)
    return echo.text(index) + generated[0], ids + generated[1], prompt_logprobs + generated[2]
