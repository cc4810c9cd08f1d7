"""An Anthropic Messages body as the /v1/chat/completions body it means: `system` first, each message's
blocks as chat messages (text as content, `thinking` as an assistant's reasoning, `tool_use` as its
tool_calls, each `tool_result` as a tool message), Anthropic's `tools` and `tool_choice` in chat's shapes,
`stop_sequences` as `stop`. Every field is checked with Anthropic's names and ranges; parse_chat then checks
the chat body as it would a chat request's.
"""

from __future__ import annotations

import json
from typing import Any

from pagedserve.api.chat import MAX_ID_CHARS
from pagedserve.api.errors import invalid
from pagedserve.api.fields import (
    MAX_INT,
    MAX_MESSAGES,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    Fields,
    is_int,
    show,
)

MESSAGES_FIELDS = frozenset(
    {"model", "messages", "system", "max_tokens", "stop_sequences", "temperature", "top_p", "top_k"}
    | {"tools", "tool_choice", "thinking", "stream", "metadata", "service_tier"}
)
COUNT_TOKENS_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "thinking"})
MESSAGES_REFUSED = {
    "mcp_servers": "'mcp_servers' is not supported: this server calls no tools itself",
    "container": "'container' is not supported: this server runs no code",
    "context_management": "'context_management' is not supported: send the messages to keep",
}
TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "cache_control", "strict"})
BLOCK_TYPES = {
    "user": ("text", "tool_result"),
    "assistant": ("text", "thinking", "tool_use"),
}
MIN_THINKING_BUDGET = 1024  # Anthropic's


def _block_text(value: Any, where: str) -> str:
    """A text (tool results': a string or a list of text blocks)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in value
    ):
        return "".join(b["text"] for b in value)
    raise invalid(f"{where} must be a string or a list of text blocks (only text is supported)", "messages")


def _message(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: a user turn's tool results come first, as tool messages."""
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant") or set(m) - {"role", "content"}:
        raise invalid(f"{where} must be {{'role': 'user' or 'assistant', 'content': ...}}", "messages")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content must be a string or a list of content blocks", "messages")
    texts, reasoning, calls, results = [], [], [], []
    for j, block in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in BLOCK_TYPES[role]:
            allowed = ", ".join(BLOCK_TYPES[role])
            raise invalid(f"{at}: a {role} message's blocks must be {allowed}; got {show(kind)}", "messages")
        if kind == "text":
            texts.append(_block_text([block], at))
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise invalid(f"{at}.thinking must be a string", "messages")
            reasoning.append(block["thinking"])
        elif kind == "tool_use":
            call_id, name, arguments = block.get("id"), block.get("name"), block.get("input")
            if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_ID_CHARS:
                raise invalid(f"{at}.id must be a string of 1 to {MAX_ID_CHARS} characters", "messages")
            if not isinstance(name, str) or not isinstance(arguments, dict):
                raise invalid(f"{at} must have a 'name' and an 'input' object", "messages")
            function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": call_id, "type": "function", "function": function})
        else:
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_ID_CHARS:
                message = f"{at}.tool_use_id must be a string of 1 to {MAX_ID_CHARS} characters"
                raise invalid(message, "messages")
            text = _block_text(block.get("content", ""), f"{at}.content")
            if block.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
    if role == "user":
        return [*results, *([{"role": "user", "content": "".join(texts)}] if texts or not results else [])]
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _system(value: Any) -> list[dict[str, Any]]:
    if value is None:
        return []
    if isinstance(value, str):
        return [{"role": "system", "content": value}] if value else []
    return [{"role": "system", "content": _block_text(value, "'system'")}]


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise invalid("'tools' must be a list of tools", "tools")
    tools = []
    for i, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom" or set(tool) - TOOL_KEYS:
            raise invalid(
                f"tools[{i}] must be a custom tool {{'name', 'description', 'input_schema'}}",
                "tools",
            )
        function = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema")
        tools.append({"type": "function", "function": function})  # checked as chat's (api/tools.py)
    return tools


def _tool_choice(value: Any, chat: dict[str, Any]) -> None:
    if value is None:
        return
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("auto", "any", "tool", "none") or set(value) - {
        "type",
        "name",
        "disable_parallel_tool_use",
    }:
        raise invalid(
            "'tool_choice' must be {'type': 'auto', 'any', 'tool' (with 'name') or 'none'}", "tool_choice"
        )
    if kind == "tool":
        if not isinstance(value.get("name"), str):
            raise invalid("'tool_choice' of type 'tool' needs the tool's 'name'", "tool_choice")
        chat["tool_choice"] = {"type": "function", "function": {"name": value["name"]}}
    else:
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
    parallel = value.get("disable_parallel_tool_use")
    if parallel is not None:
        if not isinstance(parallel, bool):
            raise invalid("'tool_choice.disable_parallel_tool_use' must be a boolean", "tool_choice")
        chat["parallel_tool_calls"] = not parallel


def _thinking(value: Any, max_tokens: int | None) -> bool:
    """Whether the request turns thinking off (`disabled`): the chat template's enable_thinking false.
    `enabled` (with Anthropic's budget rules) and `adaptive` leave it on; max_tokens bounds it."""
    if value is None:
        return False
    kind = value.get("type") if isinstance(value, dict) else None
    if kind not in ("enabled", "disabled", "adaptive"):
        raise invalid(
            "'thinking' must be {'type': 'enabled', 'budget_tokens'}, 'adaptive' or 'disabled'", "thinking"
        )
    if value.get("display") not in (None, "summarized"):
        raise invalid("'thinking.display' is not supported (only 'summarized')", "thinking")
    if kind == "enabled":
        budget = value.get("budget_tokens")
        if (
            not is_int(budget)
            or budget < MIN_THINKING_BUDGET
            or (max_tokens is not None and budget >= max_tokens)
        ):
            message = (
                f"'thinking.budget_tokens' must be at least {MIN_THINKING_BUDGET} and less than max_tokens"
            )
            raise invalid(message, "thinking")
    return kind == "disabled"


def chat_body(body: Any, counting: bool = False) -> dict[str, Any]:
    """The chat request of a /v1/messages body (`counting`: of a count_tokens body, which has no
    max_tokens and generates nothing)."""
    if not isinstance(body, dict):
        raise invalid("the request body must be a JSON object")
    f = Fields(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw or len(raw) > MAX_MESSAGES:
        raise invalid(f"'messages' must be a non-empty list of at most {MAX_MESSAGES} messages", "messages")
    messages = [*_system(body.get("system")), *(c for i, m in enumerate(raw) for c in _message(m, i))]
    chat: dict[str, Any] = {"messages": messages}
    last = messages[-1]
    if last["role"] == "assistant" and last["content"] and not last.get("tool_calls"):
        # Anthropic's prefill: the answer continues the final assistant text (and shows only what follows)
        chat.update(continue_final_message=True, add_generation_prompt=False)
    max_tokens = None
    if not counting:
        max_tokens = f.integer("max_tokens", None, lo=1, hi=MAX_INT)
        if max_tokens is None:
            raise invalid("'max_tokens' is required", "max_tokens")
        chat.update(max_tokens=max_tokens, stream=f.boolean("stream"))
        for name in ("temperature", "top_p"):  # Anthropic's ranges: both in [0, 1]
            if body.get(name) is not None:
                chat[name] = f.number(name, 1.0, 0.0, 1.0)
        if body.get("top_k") is not None:
            chat["top_k"] = f.integer("top_k", None, lo=0)
        stops = body.get("stop_sequences")
        if stops is not None:
            if (
                not isinstance(stops, list)
                or len(stops) > MAX_STOP_STRINGS
                or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops)
            ):
                message = (
                    f"'stop_sequences' must be a list of at most {MAX_STOP_STRINGS} non-empty strings of at "
                    f"most {MAX_STOP_CHARS} characters"
                )
                raise invalid(message, "stop_sequences")
            if stops:
                chat["stop"] = stops
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
    _tool_choice(body.get("tool_choice"), chat)
    if _thinking(body.get("thinking"), max_tokens):
        chat["chat_template_kwargs"] = {"enable_thinking": False}
    return chat
