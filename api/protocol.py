"""OpenAI request bodies to prompts and SamplingParams, refusing (HTTP 400) whatever we would not honour.

A field we do not support is refused rather than ignored when it would change the output; fields that
change nothing (`user`, `metadata`, ...) are accepted and dropped, because load generators send them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from api.errors import invalid
from api.model import ServedModel
from common.messages import SamplingParams

# Accepted and dropped: they change nothing about the output.
IGNORED_FIELDS = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "parallel_tool_calls",
        "prompt_cache_key",
        "safety_identifier",
    }
)
SAMPLING_FIELDS = frozenset(
    {"model", "n", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "stream"}
    | {"stream_options", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias"}
    | {"min_tokens", "min_p", "max_tokens"}
)
# How the scheduler treats the request rather than what it generates (vLLM's extensions of the same names).
SCHEDULING_FIELDS = frozenset({"priority", "cache_salt"})
COMPLETION_FIELDS = SAMPLING_FIELDS | SCHEDULING_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
COMPLETION_FIELDS |= {"use_beam_search", "length_penalty"}
CHAT_FIELDS = SAMPLING_FIELDS | SCHEDULING_FIELDS | {"messages", "max_completion_tokens", "logprobs"}
CHAT_FIELDS |= {"top_logprobs", "response_format", "tools", "tool_choice"}
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
MAX_INT = 2**31 - 1  # bounds integers we forward, so they always fit the wire format


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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class Fields:
    """Typed access to a JSON object's fields; a wrong type is a 400 that names the field."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def integer(
        self, name: str, default: int | None = None, lo: int = -MAX_INT, hi: int = MAX_INT
    ) -> int | None:
        value = self.body.get(name)
        if value is None:
            return default
        if not _is_int(value):
            raise invalid(f"'{name}' must be an integer, got {value!r}", name)
        if not lo <= value <= hi:
            raise invalid(f"'{name}' must be between {lo} and {hi}, got {value}", name)
        return value

    def number(self, name: str, default: float) -> float:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise invalid(f"'{name}' must be a number, got {value!r}", name)
        return float(value)

    def boolean(self, name: str, default: bool = False) -> bool:
        value = self.body.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise invalid(f"'{name}' must be a boolean, got {value!r}", name)
        return value

    def neutral(self, name: str, *allowed: Any) -> None:
        """Refuses any value but the ones that leave the output unchanged."""
        value = self.body.get(name)
        if value is not None and not any(value == a and type(value) is not bool for a in allowed):
            raise invalid(f"'{name}' is not supported (only {allowed[0]!r}), got {value!r}", name)

    def nonempty_string(self, name: str) -> str:
        """A string field that must not be empty when given; "" when absent."""
        value = self.body.get(name)
        if value is None:
            return ""
        if not isinstance(value, str) or not value:
            raise invalid(f"'{name}' must be a non-empty string, got {value!r}", name)
        return value

    def stop_strings(self) -> tuple[str, ...]:
        value = self.body.get("stop")
        if value is None:
            return ()
        stops = [value] if isinstance(value, str) else value
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise invalid("'stop' must be a non-empty string or a list of them", "stop")
        return tuple(stops)

    def token_ids(self, name: str, vocab_size: int) -> tuple[int, ...]:
        value = self.body.get(name)
        if value is None:
            return ()
        if not isinstance(value, list) or not all(_is_int(t) and 0 <= t < vocab_size for t in value):
            raise invalid(f"'{name}' must be a list of token ids in [0, {vocab_size})", name)
        return tuple(value)


def check_fields(body: Any, allowed: frozenset[str]) -> Fields:
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    unknown = sorted(set(body) - allowed - IGNORED_FIELDS)
    if unknown:
        raise invalid(f"unsupported parameter(s): {', '.join(unknown)}", unknown[0])
    return Fields(body)


def _max_tokens(requested: int | None, prompt: list[int], model: ServedModel) -> int:
    room = model.max_model_len - len(prompt)
    if room < 1:
        raise invalid(
            f"the prompt is {len(prompt)} tokens, and this model's maximum context length is "
            f"{model.max_model_len} tokens (prompt and output)",
            "prompt",
            "context_length_exceeded",
        )
    if requested is not None and requested > room:
        raise invalid(
            f"this model's maximum context length is {model.max_model_len} tokens, but you requested "
            f"{len(prompt) + requested} ({len(prompt)} in the prompt, {requested} to generate)",
            "max_tokens",
            "context_length_exceeded",
        )
    if requested is not None:
        return requested
    # By default, as much as fits: in the context, and (for one sequence) in the KV pool.
    pool_room = model.kv_capacity_tokens - len(prompt)
    return min(room, pool_room) if pool_room > 0 else room


def _generation_request(
    f: Fields,
    prompts: list[list[int]],
    max_tokens: int | None,
    num_logprobs: int | None,
    model: ServedModel,
    beam_width: int = 0,
) -> GenerationRequest:
    for name in ("presence_penalty", "frequency_penalty", "min_p"):
        f.neutral(name, 0)
    f.neutral("repetition_penalty", 1)
    f.neutral("min_tokens", 0)
    f.neutral("logit_bias", {})
    top_k = f.integer("top_k", 0, lo=-1)
    base = SamplingParams(
        n=f.integer("n", 1, lo=1, hi=128),  # type: ignore[arg-type]
        temperature=f.number("temperature", 0.0 if beam_width else 1.0),
        top_p=f.number("top_p", 1.0),
        top_k=max(top_k or 0, 0),  # -1 means off, as in vLLM
        seed=f.integer("seed", None, lo=-(2**63), hi=2**64 - 1),
        stop_token_ids=f.token_ids("stop_token_ids", model.vocab_size),
        ignore_eos=f.boolean("ignore_eos"),
        logprobs=num_logprobs,
        stop=f.stop_strings(),
        beam_width=beam_width,
        length_penalty=f.number("length_penalty", 1.0) if beam_width else 1.0,
    )
    problem = base.validate()
    if problem is not None:
        raise invalid(problem)
    params = [
        SamplingParams(**{**base.__dict__, "max_tokens": _max_tokens(max_tokens, p, model)}) for p in prompts
    ]
    stream = f.boolean("stream")
    if stream and beam_width:
        raise invalid("beam search results are complete only at the end: 'stream' is not supported", "stream")
    options = f.body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise invalid("'stream_options' supports only 'include_usage'", "stream_options")
    include_usage = stream and Fields(options or {}).boolean("include_usage")
    return GenerationRequest(
        prompts,
        params,
        stream,
        include_usage,
        num_logprobs,
        priority=f.integer("priority", 0),  # type: ignore[arg-type]
        cache_salt=f.nonempty_string("cache_salt"),
    )


def _prompt_ids(value: Any, model: ServedModel) -> list[int] | None:
    """Token ids of one prompt (a string or a list of ids); None when `value` is neither."""
    if isinstance(value, str):
        return list(model.tokenizer(value, add_special_tokens=True)["input_ids"]) if value else []
    if isinstance(value, list) and value and all(_is_int(t) for t in value):
        if not all(0 <= t < model.vocab_size for t in value):
            raise invalid(f"prompt token ids must be in [0, {model.vocab_size})", "prompt")
        return list(value)
    return None


def parse_completion(body: Any, model: ServedModel) -> GenerationRequest:
    """A /v1/completions body. `prompt` is a string, a list of token ids, or a list of either (a batch)."""
    f = check_fields(body, COMPLETION_FIELDS)
    if f.boolean("echo"):
        raise invalid("'echo' is not supported", "echo")
    f.neutral("suffix", "")
    raw = body.get("prompt")
    single = _prompt_ids(raw, model)
    if single is not None:
        prompts = [single]
    elif isinstance(raw, list) and raw:
        prompts = [_prompt_ids(p, model) for p in raw]  # type: ignore[misc]
    else:
        prompts = [None]  # type: ignore[list-item]
    if any(p is None for p in prompts):
        raise invalid("'prompt' must be a string, a list of token ids, or a list of those", "prompt")
    if any(not p for p in prompts):
        raise invalid("the prompt must not be empty", "prompt")
    n = f.integer("n", 1)
    best_of = f.integer("best_of")
    beam_width = 0
    if f.boolean("use_beam_search"):
        beam_width = best_of if best_of is not None else n  # type: ignore[assignment]
    elif best_of is not None and best_of != n:
        raise invalid("'best_of' must equal 'n' (no hidden candidates are generated)", "best_of")
    else:
        f.neutral("length_penalty", 1)
    num_logprobs = f.integer("logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    max_tokens = f.integer("max_tokens", None, lo=1, hi=2**63)
    return _generation_request(f, prompts, max_tokens, num_logprobs, model, beam_width)


def _message_content(message: dict[str, Any], i: int) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"messages[{i}].content: only text parts are supported", "messages")
            parts.append(part["text"])
        return "\n".join(parts)
    raise invalid(f"messages[{i}].content must be a string or a list of text parts", "messages")


def render_chat(messages: Any, model: ServedModel) -> list[int]:
    """The prompt's token ids: the messages through the chat template, special tokens not added twice."""
    if not isinstance(messages, list) or not messages:
        raise invalid("'messages' must be a non-empty list", "messages")
    rendered = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in CHAT_ROLES:
            raise invalid(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}", "messages")
        if m.get("tool_calls"):
            raise invalid("tool calls are not supported", "messages")
        name = m.get("name")
        entry = {"role": CHAT_ROLES[m["role"]], "content": _message_content(m, i)}
        rendered.append(entry if name is None else {**entry, "name": name})
    if not getattr(model.tokenizer, "chat_template", None):
        raise invalid("this model has no chat template")
    try:
        text = model.tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # the template rejects some conversations (role order, say) by raising
        raise invalid(f"the chat template refused the messages: {e}", "messages") from e
    return list(model.tokenizer(text, add_special_tokens=False)["input_ids"])


def parse_chat(body: Any, model: ServedModel) -> GenerationRequest:
    """A /v1/chat/completions body."""
    f = check_fields(body, CHAT_FIELDS)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise invalid("only the 'text' response_format is supported", "response_format")
    if body.get("tools"):
        raise invalid("tools are not supported", "tools")
    f.neutral("tool_choice", "none", "auto")
    max_tokens = f.integer("max_completion_tokens", None, lo=1, hi=2**63)
    if max_tokens is None:
        max_tokens = f.integer("max_tokens", None, lo=1, hi=2**63)
    top_logprobs = f.integer("top_logprobs", None, lo=0, hi=SamplingParams.MAX_LOGPROBS)
    want_logprobs = f.boolean("logprobs")
    if top_logprobs is not None and not want_logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    num_logprobs = (top_logprobs or 0) if want_logprobs else None
    prompt = render_chat(body.get("messages"), model)
    return _generation_request(f, [prompt], max_tokens, num_logprobs, model)
