"""Which top-level fields of a request body the api reads, drops with a warning, or refuses.

SDKs and frameworks send fields that we do not know (`reasoning_effort`, `verbosity`, `prediction`, fields of
newer API versions). As vLLM does, such a field is ignored and the request served: the api logs one warning
line per request naming them, and (which vLLM does not) tells the client in the `X-Ignored-Fields` response
header. `--strict-request-fields` refuses them instead (400), as the api did before.

A field we know and would do wrongly is refused whatever the mode (REFUSED_FIELDS): `functions` and
`function_call` (OpenAI's deprecated tools, whose answer is a `function_call` message that we never write),
audio output, web search, vLLM's prompt truncation and custom logits processors. Only their non-null values
are refused: a null (or false) asks for nothing.
"""

from __future__ import annotations

import heapq
import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from pagedserve.api.errors import invalid
from pagedserve.api.state import RECORD, STATE
from pagedserve.common.log import get_logger

log = get_logger(component="api.request_fields")

IGNORED_FIELDS_HEADER = "X-Ignored-Fields"
MAX_LISTED_FIELDS = 16  # names in the header and the log line; the rest are counted
MAX_LISTED_NAME_CHARS = 64  # of each name as listed (escaped), so one header stays under ~1.2 KB

_TOOLS_INSTEAD = (
    "'{}' is OpenAI's deprecated form of tools and is not supported: send 'tools' (and 'tool_choice' for "
    "'function_call'); calls come back as 'tool_calls'"
)
REFUSED_FIELDS: Mapping[str, str] = {
    "functions": _TOOLS_INSTEAD.format("functions"),
    "function_call": _TOOLS_INSTEAD.format("function_call"),
    "audio": "'audio' output is not supported: this server generates text",
    "web_search_options": "'web_search_options' is not supported: this server does not search the web",
    "truncate_prompt_tokens": "'truncate_prompt_tokens' is not supported: shorten the prompt",
    "logits_processors": "'logits_processors' (custom processors by name) is not supported",
    "prompt_embeds": "'prompt_embeds' is not supported: send the prompt as text or token ids",
    "echo": "'echo' (vLLM's: the last message repeated in the answer) is not supported on chat",
}


def listed(names: list[str]) -> str:
    """The names as one header value and log field: the first MAX_LISTED_FIELDS in sorted order, as
    printable ASCII (escaped as JSON escapes them, commas too), each at most MAX_LISTED_NAME_CHARS, then how
    many in all. Linear in the number of names (an 8 MB body holds a million)."""
    shown = []
    for name in heapq.nsmallest(MAX_LISTED_FIELDS, names):
        escaped = json.dumps(name)[1:-1].replace(",", "\\u002c")
        cut = len(escaped) > MAX_LISTED_NAME_CHARS
        shown.append(escaped[:MAX_LISTED_NAME_CHARS] + "..." if cut else escaped)
    if len(names) > MAX_LISTED_FIELDS:
        shown.append(f"... ({len(names)} in all)")
    return ", ".join(shown)


def screen_fields(
    body: Any, allowed: frozenset[str], strict: bool, refused: Mapping[str, str] = REFUSED_FIELDS
) -> tuple[Any, list[str]]:
    """The body without the fields outside `allowed`, and their names. A field in `refused` with a value is
    a 400 saying why; with `strict`, so is any other. A body that is not an object is returned as it is, for
    the parser to refuse."""
    if not isinstance(body, dict):
        return body, []
    unknown = [name for name in body if name not in allowed]
    if not unknown:
        return body, []
    for name in sorted(n for n in refused if n in body and n not in allowed):
        if body[name] is not None and body[name] is not False:
            raise invalid(refused[name], name)
    if strict:
        first = heapq.nsmallest(MAX_LISTED_FIELDS, unknown)
        raise invalid(f"unsupported parameter(s): {', '.join(first)[:200]}", first[0][:100])
    return {name: value for name, value in body.items() if name in allowed}, unknown


def accept_fields(
    request: web.Request, body: Any, allowed: frozenset[str], refused: Mapping[str, str] = REFUSED_FIELDS
) -> tuple[Any, dict[str, str]]:
    """screen_fields under the server's mode, for one HTTP request: the body to parse, and the headers that
    tell the client what was ignored. Logs one warning for the request when anything was."""
    body, ignored = screen_fields(body, allowed, request.app[STATE].config.strict_request_fields, refused)
    if not ignored:
        return body, {}
    names = listed(ignored)
    request[RECORD]["ignored_fields"] = names
    log.warning("request_fields_ignored", path=request.path, fields=names, num_fields=len(ignored))
    return body, {IGNORED_FIELDS_HEADER: names}
