"""A /v1/responses body as the /v1/chat/completions body it means: `input` (a string or items) after
`instructions` and the stored conversation of `previous_response_id`, Responses-shaped `tools`,
`tool_choice` and `text.format` in chat's shapes, `max_output_tokens` as `max_tokens`.

Every field is checked here with the Responses API's names (a 400 in OpenAI's error shape naming it); what
the chat body then holds is checked again by parse_chat, as a chat request's would be.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.api.chat import MAX_ID_CHARS
from pagedserve.api.errors import invalid
from pagedserve.api.fields import MAX_INT, MAX_MESSAGES, Fields, show

# Accepted and read; the ignored ones are accepted too (metadata, user, ...) and change nothing.
RESPONSES_FIELDS = frozenset(
    {"model", "input", "instructions", "tools", "tool_choice", "parallel_tool_calls", "text", "reasoning"}
    | {"max_output_tokens", "temperature", "top_p", "stream", "store", "previous_response_id", "truncation"}
    | {"background", "metadata", "user", "safety_identifier", "prompt_cache_key", "service_tier"}
)
# Known and not served: refused when given a value (not ignored), with the reason.
RESPONSES_REFUSED = {
    "conversation": "'conversation' (server-side conversations) is not supported: use 'previous_response_id'",
    "prompt": "'prompt' (stored prompt templates) is not supported: send 'input' and 'instructions'",
    "max_tool_calls": "'max_tool_calls' is not supported: use 'parallel_tool_calls': false for one call",
}
INPUT_ROLES = {"user", "system", "developer", "assistant"}
TEXT_PART_TYPES = {"input_text", "output_text", "text", "reasoning_text"}
MAX_INSTRUCTIONS_CHARS = 1 << 20  # further bounded, with the whole prompt, by the model's context
MAX_RESPONSE_ID_CHARS = 128
EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
FORMAT_KEYS = frozenset({"type", "name", "schema", "strict", "description"})


@dataclass(frozen=True)
class ResponsesRequest:
    """What the Responses body asks for, as chat: `chat_body` goes through parse_chat."""

    chat_body: dict[str, Any]
    conversation: list[dict[str, Any]]  # the chat messages before this response's, without instructions
    store: bool
    echo: dict[str, Any]  # the request's settings the Response object repeats (tools, text, ...)


def _one_of(value: Any, names: set[str]) -> bool:
    """Whether a client's value is one of the names (a list or an object is not: they cannot be hashed)."""
    return isinstance(value, str) and value in names


def _text(content: Any, where: str) -> str:
    """A message's content: a string, or a list of text parts (input_text, output_text), concatenated."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where} must be a string or a list of text parts", "input")
    texts = []
    for j, part in enumerate(content):
        if (
            not isinstance(part, dict)
            or not _one_of(part.get("type"), TEXT_PART_TYPES)
            or not isinstance(part.get("text"), str)
        ):
            raise invalid(
                f"{where}[{j}] must be {{'type': 'input_text', 'text': ...}}: only text input is supported",
                "input",
            )
        texts.append(part["text"])
    return "".join(texts)


def _call_id(value: Any, where: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        raise invalid(f"{where}.call_id must be a string of 1 to {MAX_ID_CHARS} characters", "input")
    return value


def _open_assistant(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message that output items (reasoning, message, function calls) of one turn join."""
    if messages and messages[-1]["role"] == "assistant":
        return messages[-1]
    messages.append({"role": "assistant", "content": None})
    return messages[-1]


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages. Items of one assistant turn (reasoning, message, function_call) make one
    assistant message; a function_call_output is a tool message."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or len(value) > MAX_MESSAGES:
        raise invalid(f"'input' must be a string or a list of at most {MAX_MESSAGES} items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise invalid(f"{where} must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not _one_of(role, INPUT_ROLES):
                raise invalid(f"{where}.role must be one of {sorted(INPUT_ROLES)}, got {show(role)}", "input")
            text = _text(item.get("content"), f"{where}.content")
            last = messages[-1] if messages else None
            if (
                role == "assistant"
                and last is not None
                and last["role"] == "assistant"
                and not last["content"]
            ):
                last["content"] = text  # after this turn's reasoning item
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            name, arguments = item.get("name"), item.get("arguments")
            if not isinstance(name, str) or not isinstance(arguments, str):
                raise invalid(f"{where} must have a 'name' and 'arguments' (JSON text)", "input")
            call = {"id": _call_id(item.get("call_id"), where), "type": "function"}
            call["function"] = {"name": name, "arguments": arguments}
            _open_assistant(messages).setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = _text(item.get("output"), f"{where}.output")
            messages.append(
                {"role": "tool", "tool_call_id": _call_id(item.get("call_id"), where), "content": output}
            )
        elif kind == "reasoning":
            text = _text(item.get("content") or [], f"{where}.content")  # summaries are not the thinking
            if text:
                messages.append({"role": "assistant", "content": None, "reasoning": text})
        else:
            kinds = "message, function_call, function_call_output or reasoning"
            raise invalid(f"{where}.type must be {kinds}, got {show(kind)}", "input")
    if not messages:
        raise invalid("'input' must not be empty", "input")
    return messages


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("'tools' must be a list of function tools", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else tool
            raise invalid(f"tools[{i}]: only function tools are supported, got {show(kind)}", "tools")
        function = {k: v for k, v in tool.items() if k != "type" and v is not None}
        tools.append({"type": "function", "function": function})  # chat's checks (api/tools.py) follow
    return tools


def _tool_choice(value: Any) -> Any:
    if value is None or value in ("none", "auto", "required"):
        return value
    if isinstance(value, dict) and value.get("type") == "function" and isinstance(value.get("name"), str):
        return {"type": "function", "function": {"name": value["name"]}}
    raise invalid(
        f"'tool_choice' must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, "
        f"got {show(value)}",
        "tool_choice",
    )


def _response_format(text: Any) -> dict[str, Any] | None:
    """`text.format` as chat's `response_format`."""
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise invalid("'text' must be an object with 'format' (and 'verbosity')", "text")
    if text.get("verbosity") not in (None, "medium"):
        raise invalid("'text.verbosity' is not supported (only 'medium')", "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or set(fmt) - FORMAT_KEYS:
        raise invalid(f"'text.format' must be an object with keys among {sorted(FORMAT_KEYS)}", "text")
    kind = fmt.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise invalid(
            f"'text.format.type' must be 'text', 'json_object' or 'json_schema', got {show(kind)}", "text"
        )
    name = fmt.get("name")
    if not isinstance(name, str) or not 0 < len(name) <= 64:
        raise invalid("'text.format.name' must be a string of 1 to 64 characters", "text")
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if fmt.get(k) is not None}
    return {"type": "json_schema", "json_schema": schema}


def _thinking_off(reasoning: Any) -> bool:
    """`reasoning.effort` 'none' turns the chat template's thinking off (enable_thinking false); any other
    effort leaves it on, the model deciding how long it thinks."""
    if reasoning is None:
        return False
    if not isinstance(reasoning, dict) or set(reasoning) - {"effort", "summary", "generate_summary"}:
        raise invalid("'reasoning' must be an object with 'effort' (and 'summary')", "reasoning")
    effort = reasoning.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise invalid(f"'reasoning.effort' must be one of {list(EFFORTS)}, got {show(effort)}", "reasoning")
    if reasoning.get("summary") not in (None, "auto", "concise", "detailed"):
        raise invalid("'reasoning.summary' must be 'auto', 'concise' or 'detailed'", "reasoning")
    return effort == "none"


def _metadata(value: Any) -> dict[str, str] | None:
    """OpenAI's limits: at most 16 pairs, keys up to 64 characters, values up to 512 (echoed back)."""
    if value is not None and (
        not isinstance(value, dict)
        or len(value) > 16
        or not all(isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in value.items())
    ):
        message = "'metadata' must be an object of at most 16 strings (keys up to 64 characters, values 512)"
        raise invalid(message, "metadata")
    return value


def previous_id(body: dict[str, Any]) -> str | None:
    value = body.get("previous_response_id")
    if value is not None and (not isinstance(value, str) or not 0 < len(value) <= MAX_RESPONSE_ID_CHARS):
        message = f"'previous_response_id' must be a string of 1 to {MAX_RESPONSE_ID_CHARS} characters"
        raise invalid(message, "previous_response_id")
    return value


def translate(body: Any, history: list[dict[str, Any]]) -> ResponsesRequest:
    """The chat request of a /v1/responses body; `history` is the previous response's conversation."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    f = Fields(body)
    if f.boolean("background"):
        raise invalid("'background' responses are not supported: use 'stream'", "background")
    if body.get("truncation") not in (None, "disabled"):
        raise invalid("'truncation' is not supported (only 'disabled'): shorten the input", "truncation")
    if body.get("input") is None:
        raise invalid("'input' is required", "input")
    conversation = [*history, *input_messages(body["input"])]
    instructions = body.get("instructions")
    if instructions is not None and (
        not isinstance(instructions, str) or len(instructions) > MAX_INSTRUCTIONS_CHARS
    ):
        raise invalid(
            f"'instructions' must be a string of at most {MAX_INSTRUCTIONS_CHARS} characters", "instructions"
        )
    system = [{"role": "system", "content": instructions}] if instructions else []
    chat: dict[str, Any] = {"messages": [*system, *conversation], "stream": f.boolean("stream")}
    max_output_tokens = f.integer("max_output_tokens", None, lo=1, hi=MAX_INT)
    if max_output_tokens is not None:
        chat["max_tokens"] = max_output_tokens
    for name, hi in (("temperature", 2.0), ("top_p", 1.0)):  # OpenAI's ranges
        if body.get(name) is not None:
            chat[name] = f.number(name, 1.0, 0.0, hi)
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if (choice := _tool_choice(body.get("tool_choice"))) is not None:
        chat["tool_choice"] = choice
    if (parallel := body.get("parallel_tool_calls")) is not None:
        chat["parallel_tool_calls"] = parallel
    if (response_format := _response_format(body.get("text"))) is not None:
        chat["response_format"] = response_format
    if _thinking_off(body.get("reasoning")):
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    echo = {
        "instructions": instructions,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or ("auto" if tools else "none"),
        "parallel_tool_calls": True if parallel is None else parallel,
        "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": max_output_tokens,
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": body.get("reasoning"),
        "metadata": _metadata(body.get("metadata")),
        "store": f.boolean("store", True),
    }
    return ResponsesRequest(chat, conversation, echo["store"], echo)
