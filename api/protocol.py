"""OpenAI request bodies to prompts and SamplingParams, refusing (HTTP 400) whatever we would not honour.

A field we do not support is refused rather than ignored when it would change the output; fields that
change nothing (`user`, `metadata`, ...) are accepted and dropped, because load generators send them.
What one request may cost is bounded before any work is done: its sequences (prompts x n, or the beam
width) by ApiConfig.max_seqs_per_request, and each text prompt by the most characters that could fit the
model's context (ServedModel.max_prompt_chars), checked before it is tokenized. Parsing runs in the api's
tokenizer thread (handlers.py), so nothing here blocks the event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import msgspec

from pagedserve.api.chat import render_chat_request
from pagedserve.api.chat import too_long as _too_long
from pagedserve.api.chat_output import ChatOutput
from pagedserve.api.errors import invalid
from pagedserve.api.fields import (
    MAX_CACHE_SALT_CHARS,
    MAX_LENGTH_PENALTY,
    MAX_N,
    Fields,
    is_int,
)
from pagedserve.api.model import ServedModel
from pagedserve.api.reasoning import REASONING_PARSERS, prompt_opens_reasoning
from pagedserve.api.sampling_fields import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    PROCESSOR_FIELDS,
    default_max_tokens,
    min_tokens,
    processor_fields,
    sampling_defaults,
)
from pagedserve.api.scheduling import parse_priority
from pagedserve.api.scoring import SCORING_FIELDS, OutputOptions, parse_output_options
from pagedserve.api.structured_fields import STRUCTURED_FIELDS, parse_structured
from pagedserve.api.tool_parsers import TOOL_PARSERS
from pagedserve.api.tools import parse_tools
from pagedserve.common.config import ApiConfig
from pagedserve.common.messages import SamplingParams

# Accepted and dropped: they change nothing about the output.
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
    }
)
SAMPLING_FIELDS = frozenset(
    {"model", "n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "stream"}
    | {"stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"}
    | {"min_tokens", "min_p", "max_tokens"}
    | PROCESSOR_FIELDS
)
# How the scheduler treats the request rather than what it generates (vLLM's extensions of the same names).
SCHEDULING_FIELDS = frozenset({"priority", "cache_salt"})
COMPLETION_FIELDS = SAMPLING_FIELDS | SCHEDULING_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
COMPLETION_FIELDS |= (
    {"use_beam_search", "length_penalty", "add_special_tokens"} | SCORING_FIELDS | STRUCTURED_FIELDS
)
CHAT_FIELDS = SAMPLING_FIELDS | SCHEDULING_FIELDS | {"messages", "max_completion_tokens", "logprobs"}
CHAT_FIELDS |= {"top_logprobs", "response_format", "tools", "tool_choice"}
CHAT_FIELDS |= {"parallel_tool_calls", "chat_template", "chat_template_kwargs", "add_generation_prompt"}
CHAT_FIELDS |= {"continue_final_message", "documents", "modalities", "add_special_tokens"}
CHAT_FIELDS |= SCORING_FIELDS | STRUCTURED_FIELDS
# Other constraints on the output (vLLM's names), which a forced tool_choice cannot be combined with
OTHER_CONSTRAINTS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")


@dataclass(frozen=True)
class GenerationRequest:
    """What one HTTP request asks for: prompts as token ids, each with its sampling parameters."""

    prompts: list[list[int]]
    params: list[SamplingParams]  # one per prompt: max_tokens defaults to what fits after the prompt
    stream: bool
    include_usage: bool  # stream_options.include_usage: a final chunk with the usage
    num_logprobs: int | None  # top logprobs per token; None: no logprobs
    priority: int = 0  # under the scheduler's priority policy, lower runs first
    cache_salt: str = ""  # non-empty: prefix-cache entries shared only with requests of the same salt
    outputs: OutputOptions = OutputOptions()  # echo, prompt logprobs, token names (api/scoring.py)
    chat_output: ChatOutput | None = None  # chat: how the choices are read (reasoning, tool calls)


def check_fields(body: Any, allowed: frozenset[str]) -> Fields:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed - IGNORED_FIELDS)
    if unknown:
        raise invalid(f"unsupported parameter(s): {', '.join(unknown)[:200]}", unknown[0][:100])
    return Fields(body)


def _only(f: Fields, name: str, neutral: bool) -> None:
    """Refuses the boolean's other value, which we would not honour."""
    if f.boolean(name, neutral) is not neutral:
        raise invalid(f"'{name}' is not supported (only {neutral})", name)


def _max_tokens(requested: int | None, prompt: list[int], model: ServedModel, default: int) -> int:
    """The request's max_tokens; when it has none, `default` (if > 0) cut to what fits, else all that fits."""
    room = model.max_model_len - len(prompt)
    if room < 1:
        raise _too_long("prompt", len(prompt), model)
    if requested is not None and requested > room:
        raise invalid(
            f"this model's maximum context length is {model.max_model_len} tokens, but you requested "
            f"{len(prompt) + requested} ({len(prompt)} in the prompt, {requested} to generate)",
            "max_tokens",
            "context_length_exceeded",
        )
    if requested is not None:
        return requested
    # By default, as much as fits (in the context, and for one sequence in the KV pool), at most `default`
    pool_room = model.kv_capacity_tokens - len(prompt)
    fits = min(room, pool_room) if pool_room > 0 else room
    return min(default, fits) if default > 0 else fits


def _check_num_seqs(num_prompts: int, seqs_per_prompt: int, max_seqs: int) -> None:
    if num_prompts * seqs_per_prompt > max_seqs:
        raise invalid(
            f"this request would create {num_prompts * seqs_per_prompt} sequences ({num_prompts} prompt(s) "
            f"x {seqs_per_prompt}); at most {max_seqs} are allowed per request",
            "n",
        )


def _generation_request(
    f: Fields,
    prompts: list[list[int]],
    max_tokens: int | None,
    num_logprobs: int | None,
    model: ServedModel,
    beam_width: int = 0,
    echo: bool = False,
    default_max_tokens: int = 0,  # when max_tokens is left out (0: as much as fits)
) -> GenerationRequest:
    temperature, top_p, top_k = sampling_defaults(model, beam=bool(beam_width))  # generation_config's
    top_k = f.integer("top_k", top_k, lo=-1)
    sampling: dict[str, Any] = dict(
        n=f.integer("n", 1, lo=1, hi=MAX_N),  # type: ignore[arg-type]
        temperature=f.number("temperature", temperature, 0.0, 100.0),
        top_p=f.number("top_p", top_p, 0.0, 1.0),
        top_k=max(top_k or 0, 0),  # -1 means off, as in vLLM
        seed=f.integer("seed", None, lo=-(2**63), hi=2**64 - 1),
        stop_token_ids=f.token_ids("stop_token_ids", model.vocab_size),
        ignore_eos=f.boolean("ignore_eos"),
        logprobs=num_logprobs,
        stop=f.stop_strings(),
        beam_width=beam_width,
        length_penalty=(
            f.number("length_penalty", 1.0, -MAX_LENGTH_PENALTY, MAX_LENGTH_PENALTY) if beam_width else 1.0
        ),
        **processor_fields(f, model, beam=bool(beam_width)),
    )
    stream = f.boolean("stream")
    outputs, output_fields = parse_output_options(f, num_logprobs, max_tokens, stream, echo)
    sampling.update(output_fields)
    max_tokens = 1 if outputs.echo_only else max_tokens  # echo with max_tokens 0: one token, not shown
    sampling["structured"] = parse_structured(f.body)
    problem = SamplingParams(**sampling).validate()
    if problem is not None:
        raise invalid(problem)
    lengths = [_max_tokens(max_tokens, p, model, default_max_tokens) for p in prompts]
    params = [SamplingParams(**sampling, max_tokens=n, min_tokens=min_tokens(f, n)) for n in lengths]
    if stream and beam_width:
        raise invalid("beam search results are complete only at the end: 'stream' is not supported", "stream")
    options = f.body.get("stream_options")
    if options and not stream:  # it would change nothing: refused, as vLLM does ({} changes nothing)
        raise invalid("Stream options can only be defined when `stream=True`.", "stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise invalid("'stream_options' supports only 'include_usage'", "stream_options")
    include_usage = stream and Fields(options or {}).boolean("include_usage")
    return GenerationRequest(
        prompts,
        params,
        stream,
        include_usage,
        num_logprobs,
        priority=parse_priority(f, model),
        cache_salt=f.string("cache_salt", MAX_CACHE_SALT_CHARS),
        outputs=outputs,
    )


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def _completion_prompts(raw: Any, model: ServedModel, seqs_per_prompt: int, max_seqs: int) -> list[list[int]]:
    """`prompt` as token ids: a string, a list of ids, or a list of either (a batch). The batch's size and
    each text's length are checked before anything is tokenized."""
    batch = [raw] if isinstance(raw, str) or _is_token_ids(raw) else raw
    if not isinstance(batch, list) or not batch:
        raise invalid("'prompt' must be a string, a list of token ids, or a list of those", "prompt")
    _check_num_seqs(len(batch), seqs_per_prompt, max_seqs)
    if any(p == "" or p == [] for p in batch):
        raise invalid("the prompt must not be empty", "prompt")
    if not all(isinstance(p, str) or _is_token_ids(p) for p in batch):
        raise invalid("'prompt' must be a string, a list of token ids, or a list of those", "prompt")
    texts = [p for p in batch if isinstance(p, str)]
    if any(len(t) > model.max_prompt_chars for t in texts):
        raise _too_long("prompt", None, model)
    for ids in batch:
        if isinstance(ids, list) and not all(0 <= t < model.vocab_size for t in ids):
            raise invalid(f"prompt token ids must be in [0, {model.vocab_size})", "prompt")
    # One call for the whole batch: a fast tokenizer encodes a batch in parallel, without the GIL.
    encoded = iter(model.tokenizer(texts, add_special_tokens=True)["input_ids"] if texts else [])
    return [list(next(encoded)) if isinstance(p, str) else list(p) for p in batch]


def parse_completion(body: Any, model: ServedModel, max_seqs: int) -> GenerationRequest:
    """A /v1/completions body. `prompt` is a string, a list of token ids, or a list of either (a batch)."""
    f = check_fields(body, COMPLETION_FIELDS)
    echo = f.boolean("echo")
    f.neutral("suffix", "")
    _only(f, "add_special_tokens", True)  # the tokenizer's BOS and the like, always added
    n = f.integer("n", 1, lo=1, hi=MAX_N)
    best_of = f.integer("best_of", None, lo=1, hi=SamplingParams.MAX_BEAM_WIDTH)
    beam_width = 0
    if f.boolean("use_beam_search"):
        beam_width = best_of if best_of is not None else n  # type: ignore[assignment]
    elif best_of is not None and best_of != n:
        raise invalid("'best_of' must equal 'n' (no hidden candidates are generated)", "best_of")
    else:
        f.neutral("length_penalty", 1)
    num_logprobs = f.integer("logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    max_tokens = f.integer("max_tokens", None, lo=0 if echo else 1, hi=2**63)  # 0 with echo: the prompt alone
    prompts = _completion_prompts(body.get("prompt"), model, max(n, beam_width), max_seqs)  # type: ignore[type-var]
    return _generation_request(
        f, prompts, max_tokens, num_logprobs, model, beam_width, echo=echo,
        default_max_tokens=COMPLETION_DEFAULT_MAX_TOKENS,
    )  # fmt: skip


def parse_chat(
    body: Any, model: ServedModel, max_seqs: int, config: ApiConfig | None = None
) -> GenerationRequest:
    """A /v1/chat/completions body. Messages, tools and the template controls: api/chat.py, api/tools.py."""
    config = config or ApiConfig()
    f = check_fields(body, CHAT_FIELDS)
    f.neutral("modalities", ["text"])  # text is all we generate
    _only(f, "add_special_tokens", False)  # the template writes them (vLLM's default)
    tools = parse_tools(body, config, model.tool_call_parser)
    _check_num_seqs(1, f.integer("n", 1, lo=1, hi=MAX_N), max_seqs)  # type: ignore[arg-type]
    legacy_max_tokens = f.integer("max_tokens", None, lo=1, hi=2**63)  # checked also when overridden
    max_tokens = f.integer("max_completion_tokens", legacy_max_tokens, lo=1, hi=2**63)
    top_logprobs = f.integer("top_logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    want_logprobs = f.boolean("logprobs")
    if top_logprobs is not None and not want_logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    num_logprobs = (top_logprobs or 0) if want_logprobs else None
    prompt = render_chat_request(body, model, config, tools)
    cap = default_max_tokens(model, config.default_max_tokens)  # the checkpoint's, capped by our default
    req = _generation_request(f, [prompt.token_ids], max_tokens, num_logprobs, model, default_max_tokens=cap)
    structured = tools.structured()
    constrained = body.get("response_format") not in (None, {"type": "text"})
    if structured is not None and (constrained or any(body.get(k) is not None for k in OTHER_CONSTRAINTS)):
        raise invalid("a forced tool_choice holds the output to its own schema: drop the other constraint")
    changes: dict[str, Any] = {}
    if tools.choice == "auto" and TOOL_PARSERS[tools.parser_name].reads_special_tokens:
        changes["skip_special_tokens"] = False  # the parser reads its markers in the text
    if structured is not None:  # tool_choice required or a named function: the output is held to JSON
        changes["structured"] = structured
    if config.reasoning_parser and (constraint := structured or req.params[0].structured) is not None:
        # A reasoning model thinks first, unconstrained; the constraint holds after </think> (vLLM's rule)
        tags = REASONING_PARSERS[config.reasoning_parser].thinking_tags(prompt.text)
        if tags is not None:
            thinking = dict(zip(("reasoning_begin", "reasoning_end"), tags, strict=True))
            changes["structured"] = msgspec.structs.replace(constraint, **thinking)
    if changes:
        params = [msgspec.structs.replace(p, **changes) for p in req.params]
        if problem := params[0].validate():  # the rules that tie a constraint to the other fields
            raise invalid(problem)
        req = replace(req, params=params)
    return replace(req, chat_output=ChatOutput(tools, config, prompt_opens_reasoning(prompt.text)))
