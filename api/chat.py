"""A chat request's messages to a prompt: the history (tool results, assistant tool calls, names,
reasoning), `tools` and `documents` through the chat template, with the template controls
(`add_generation_prompt`, `continue_final_message`, `chat_template`, `chat_template_kwargs`).

Messages are given to the template as transformers' apply_chat_template takes them, and as vLLM gives them:
an assistant's `tool_calls` with their `arguments` parsed from JSON text into objects (templates write them
with `tojson`), a tool result with its `tool_call_id`. Every text a message carries counts against the
prompt's character limit before the template runs, and the rendered text after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedserve.api.chat_template import SANDBOX, request_template, server_template, template_kwargs
from pagedserve.api.errors import ApiError, invalid
from pagedserve.api.fields import MAX_MESSAGES, MAX_NAME_CHARS, Fields, show
from pagedserve.api.model import ServedModel
from pagedserve.api.tools import ToolOptions
from pagedserve.common.config import ApiConfig

CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}
MAX_TOOL_CALLS = 128  # in one assistant message
MAX_ID_CHARS = 256  # a tool call's id
MAX_DOCUMENTS = 256


@dataclass(frozen=True)
class RenderedChat:
    text: str  # the prompt as text, for the reasoning parser's look at how it ends
    token_ids: list[int]


def too_long(what: str, num_tokens: int | None, model: ServedModel) -> ApiError:
    """The 400 for a prompt (or conversation) that cannot fit the model's context."""
    size = f"{num_tokens} tokens" if num_tokens is not None else f"over {model.max_prompt_chars} characters"
    return invalid(
        f"the {what} is {size}, and this model's maximum context length is "
        f"{model.max_model_len} tokens (prompt and output)",
        "prompt" if what == "prompt" else "messages",
        "context_length_exceeded",
    )


def _text(value: Any, where: str, allow_none: bool = False) -> str | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        parts = []
        for part in value:
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                raise invalid(f"{where}: only text parts are supported", "messages")
            parts.append(part["text"])
        return "\n".join(parts)
    kinds = "a string, a list of text parts" + (" or null" if allow_none else "")
    raise invalid(f"{where} must be {kinds}", "messages")


def _tool_calls(value: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list) or len(value) > MAX_TOOL_CALLS:
        raise invalid(f"{where} must be a list of at most {MAX_TOOL_CALLS} tool calls", "messages")
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise invalid(
                f"{at} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", "messages"
            )
        call_id, name, arguments = call.get("id"), function.get("name"), function.get("arguments", "{}")
        if call_id is not None and (not isinstance(call_id, str) or len(call_id) > MAX_ID_CHARS):
            raise invalid(f"{at}.id must be a string of at most {MAX_ID_CHARS} characters", "messages")
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise invalid(
                f"{at}.function.name must be a string of 1 to {MAX_NAME_CHARS} characters", "messages"
            )
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise invalid(
                    f"{at}.function.arguments must be JSON text, got {show(arguments)}", "messages"
                ) from None
        if not isinstance(arguments, dict):
            raise invalid(f"{at}.function.arguments must be a JSON object", "messages")
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if call_id is not None:
            entry["id"] = call_id
        calls.append(entry)
    return calls


def convert_messages(messages: Any) -> tuple[list[dict[str, Any]], int]:
    """The messages as the template takes them, and how many characters of text they hold."""
    if not isinstance(messages, list) or not messages or len(messages) > MAX_MESSAGES:
        raise invalid(f"'messages' must be a non-empty list of at most {MAX_MESSAGES}", "messages")
    converted = []
    num_chars = 0
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in CHAT_ROLES:
            raise invalid(f"{where}.role must be one of {sorted(CHAT_ROLES)}", "messages")
        role = CHAT_ROLES[m["role"]]
        has_calls = role == "assistant" and bool(m.get("tool_calls"))
        content = _text(m.get("content"), f"{where}.content", allow_none=role == "assistant")
        entry: dict[str, Any] = {"role": role, "content": content}
        name = m.get("name")
        if name is not None:
            if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
                message = f"{where}.name must be a string of 1 to {MAX_NAME_CHARS} characters"
                raise invalid(message, "messages")
            entry["name"] = name
        if m.get("tool_calls") is not None and role != "assistant":
            raise invalid(f"{where}: only assistant messages have tool_calls", "messages")
        if has_calls:
            entry["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
            num_chars += len(json.dumps(entry["tool_calls"], ensure_ascii=False))
        if role == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not 0 < len(call_id) <= MAX_ID_CHARS:
                message = f"{where}.tool_call_id must be a string of 1 to {MAX_ID_CHARS} characters"
                raise invalid(message, "messages")
            entry["tool_call_id"] = call_id
        reasoning = m.get("reasoning", m.get("reasoning_content")) if role == "assistant" else None
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise invalid(f"{where}.reasoning must be a string", "messages")
            # Chat templates read `reasoning_content` (Qwen3's, DeepSeek's); vLLM now calls it `reasoning`.
            entry["reasoning"] = entry["reasoning_content"] = reasoning
            num_chars += len(reasoning)
        num_chars += len(content or "")
        converted.append(entry)
    return converted, num_chars


def _documents(value: Any) -> list[dict[str, str]] | None:
    if value is None:
        return None
    if (
        not isinstance(value, list)
        or len(value) > MAX_DOCUMENTS
        or not all(isinstance(d, dict) and all(isinstance(v, str) for v in d.values()) for d in value)
    ):
        message = f"'documents' must be a list of at most {MAX_DOCUMENTS} objects of strings (title, text)"
        raise invalid(message, "documents")
    return value


def render_chat_request(
    body: dict[str, Any], model: ServedModel, config: ApiConfig, tools: ToolOptions
) -> RenderedChat:
    """The prompt of a /v1/chat/completions body."""
    f = Fields(body)
    messages, num_chars = convert_messages(body.get("messages"))
    documents = _documents(body.get("documents"))
    num_chars += len(json.dumps(tools.tools, ensure_ascii=False)) if tools.tools else 0
    num_chars += sum(len(v) for d in documents or [] for v in d.values())
    if num_chars > model.max_prompt_chars:  # the template's output holds all of it
        raise too_long("conversation", None, model)
    continue_final = f.boolean("continue_final_message")
    add_generation_prompt = f.boolean("add_generation_prompt", True)
    if continue_final and add_generation_prompt:
        message = "Cannot set both `continue_final_message` and `add_generation_prompt` to True."  # vLLM's
        raise invalid(message, "continue_final_message")
    if continue_final and messages[-1]["role"] != "assistant":
        raise invalid("'continue_final_message' needs the last message to be the assistant's", "messages")
    tokenizer = model.tokenizer
    kwargs = template_kwargs(body.get("chat_template_kwargs"), tokenizer.special_tokens_map)
    own_template = request_template(body.get("chat_template"), config.trust_request_chat_template)
    template = own_template or server_template(config.chat_template)
    if template is None and not getattr(tokenizer, "chat_template", None):
        raise invalid("this model has no chat template: start the server with --chat-template")
    options: dict[str, Any] = dict(
        tools=tools.tools or None,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final,
    )
    try:
        if own_template is not None:
            options.update(tokenizer.special_tokens_map, **kwargs)
            text = SANDBOX.render(own_template, messages, options)
        else:
            text = tokenizer.apply_chat_template(
                messages, chat_template=template, tokenize=False, **options, **kwargs
            )
    except Exception as e:  # the template rejects some conversations (role order, say) by raising
        if getattr(e, "status", None) == 400:
            raise
        raise invalid(f"the chat template refused the messages: {str(e)[:200]}", "messages") from e
    if not isinstance(text, str):
        raise invalid("the chat template did not render text", "messages")
    if len(text) > model.max_prompt_chars:
        raise too_long("conversation", None, model)
    return RenderedChat(text, list(tokenizer(text, add_special_tokens=False)["input_ids"]))
