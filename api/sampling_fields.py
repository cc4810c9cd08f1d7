"""The request fields of the logits processors (worker/logits_processors.py), with vLLM's names, ranges and
semantics: presence_penalty, frequency_penalty, repetition_penalty, min_p, min_tokens, logit_bias, bad_words
and allowed_token_ids; and the defaults a request that leaves a field out gets from the checkpoint's
generation_config.json (api/generation_config.py). Every value is checked here and refused with a 400
naming the field; `SamplingParams.validate()` checks the same ranges again in the scheduler.

bad_words are tokenized as vLLM does: each word without its leading spaces, and again after one space (the
word in mid-text) when that gives as many tokens and another first token; a word's last token is then banned
wherever the generated tokens end with its other tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.api.errors import invalid
from pagedserve.api.fields import Fields, is_int, show
from pagedserve.api.generation_config import GenerationDefaults
from pagedserve.common.sampling_params import (
    MAX_ALLOWED_TOKEN_IDS,
    MAX_BAD_WORD_TOKENS,
    MAX_BAD_WORDS,
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_PENALTY,
)

if TYPE_CHECKING:
    from pagedserve.api.model import ServedModel

COMPLETION_DEFAULT_MAX_TOKENS = 16  # /v1/completions without max_tokens, as OpenAI's and vLLM's
MAX_BAD_WORD_STRINGS = MAX_BAD_WORDS // 2  # each word may become two token sequences
MAX_BAD_WORD_CHARS = 1024
PROCESSOR_FIELDS = frozenset(
    {"presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias"}
    | {"bad_words", "allowed_token_ids"}
)


def defaults_of(model: ServedModel) -> GenerationDefaults:
    return getattr(model, "generation_defaults", None) or GenerationDefaults()


def processor_fields(f: Fields, model: ServedModel, beam: bool = False) -> dict[str, Any]:
    """SamplingParams' processor fields from the request (all but min_tokens, which `min_tokens` checks
    against max_tokens). With beam search the checkpoint's defaults do not apply: a beam's candidates are the
    raw distribution's, which no processor changes (SamplingParams.validate refuses them)."""
    defaults = GenerationDefaults() if beam else defaults_of(model)
    repetition = f.number("repetition_penalty", defaults.repetition_penalty or 1.0, 0.0, MAX_PENALTY)
    if not repetition > 0.0:
        raise invalid(f"'repetition_penalty' must be in (0, {MAX_PENALTY}], got 0", "repetition_penalty")
    return dict(
        presence_penalty=f.number("presence_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        frequency_penalty=f.number("frequency_penalty", 0.0, -MAX_PENALTY, MAX_PENALTY),
        repetition_penalty=repetition,
        min_p=f.number("min_p", defaults.min_p or 0.0, 0.0, 1.0),
        logit_bias=logit_bias(f, model.vocab_size),
        bad_words=bad_words(f, model),
        allowed_token_ids=allowed_token_ids(f, model.vocab_size),
    )


def sampling_defaults(model: ServedModel, beam: bool = False) -> tuple[float, float, int]:
    """The temperature, top_p and top_k of a request that leaves them out: the checkpoint's, else 1, 1, 0
    (beam search: temperature 0, nothing else)."""
    if beam:
        return 0.0, 1.0, 0
    d = defaults_of(model)
    return (
        d.temperature if d.temperature is not None else 1.0,
        d.top_p if d.top_p is not None else 1.0,
        d.top_k if d.top_k is not None else 0,
    )


def default_max_tokens(model: ServedModel, cap: int = 0) -> int:
    """A chat request's max_tokens when it has none (0: as much as fits): the smaller of the checkpoint's
    max_new_tokens, as in vLLM, and `cap` (ApiConfig.default_max_tokens), where each is set. A completion's
    default is OpenAI's 16, which vLLM's request sets before any default applies."""
    return min((n for n in (defaults_of(model).max_tokens or 0, cap) if n > 0), default=0)


def min_tokens(f: Fields, max_tokens: int) -> int:
    value = f.integer("min_tokens", 0, lo=0)
    assert value is not None
    if value > max_tokens:
        raise invalid(f"'min_tokens' must be at most max_tokens ({max_tokens}), got {value}", "min_tokens")
    return value


def logit_bias(f: Fields, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings, or ints) to a bias in [-100, 100], as (id, bias) pairs."""
    value = f.body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' must be an object of at most {MAX_LOGIT_BIAS} entries", "logit_bias")
    pairs: dict[int, float] = {}
    for key, bias in value.items():
        token = _token_key(key)
        if token is None or not 0 <= token < vocab_size:
            message = f"'logit_bias' keys must be token ids in [0, {vocab_size}), got {show(key)}"
            raise invalid(message, "logit_bias")
        if token in pairs:
            raise invalid(f"'logit_bias' names token {token} twice", "logit_bias")
        pairs[token] = Fields({"logit_bias": bias}).number(
            "logit_bias", 0.0, -MAX_LOGIT_BIAS_VALUE, MAX_LOGIT_BIAS_VALUE
        )
    return tuple(pairs.items())


def _token_key(key: Any) -> int | None:
    if is_int(key):
        return key
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10:
        return int(key)
    return None


def allowed_token_ids(f: Fields, vocab_size: int) -> tuple[int, ...]:
    if f.body.get("allowed_token_ids") == []:
        raise invalid("'allowed_token_ids' must not be empty", "allowed_token_ids")
    return f.token_ids("allowed_token_ids", vocab_size, MAX_ALLOWED_TOKEN_IDS)


def bad_words(f: Fields, model: ServedModel) -> tuple[tuple[int, ...], ...]:
    """The words' token sequences, tokenized as vLLM tokenizes them."""
    value = f.body.get("bad_words")
    if value is None:
        return ()
    if (
        not isinstance(value, list)
        or len(value) > MAX_BAD_WORD_STRINGS
        or not all(isinstance(w, str) and w.strip() and len(w) <= MAX_BAD_WORD_CHARS for w in value)
    ):
        raise invalid(
            f"'bad_words' must be a list of at most {MAX_BAD_WORD_STRINGS} non-blank strings of at most "
            f"{MAX_BAD_WORD_CHARS} characters",
            "bad_words",
        )
    encode = model.tokenizer
    sequences: list[tuple[int, ...]] = []
    for word in value:
        plain = list(encode(word.lstrip(), add_special_tokens=False)["input_ids"])
        spaced = list(encode(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
        found = [plain]
        if spaced and plain and spaced[0] != plain[0] and len(spaced) == len(plain):
            found.append(spaced)
        for ids in found:
            if not 1 <= len(ids) <= MAX_BAD_WORD_TOKENS:
                size = f"{show(word)} is {len(ids)}"
                message = f"each bad word must be 1 to {MAX_BAD_WORD_TOKENS} tokens, {size}"
                raise invalid(message, "bad_words")
            if not all(0 <= t < model.vocab_size for t in ids):
                raise invalid(f"bad word {show(word)} has tokens outside the model's vocabulary", "bad_words")
            sequences.append(tuple(ids))
    return tuple(sequences)
