"""The X-Request-Id header: taken from the request when given, made up otherwise, and sent back on every
response (errors and streams included), as vLLM does.

The id names the request where a client or a proxy can find it again: the response's `id`
("cmpl-<id>", "chatcmpl-<id>", as in vLLM), the `X-Request-Id` response header, and the api's access log
line (`x_request_id`, beside the scheduler request ids it led to). The scheduler's own request ids stay the
client library's (unique per connection), since two HTTP requests may carry the same header.

vLLM forwards whatever the header holds. Here it is bounded, because it is echoed in a header and written
to the logs: at most MAX_REQUEST_ID_CHARS printable ASCII characters, else a 400 (answered under a fresh id).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from pagedserve.api.errors import invalid
from pagedserve.api.state import RECORD

HEADER = "X-Request-Id"
MAX_REQUEST_ID_CHARS = 256  # W3C trace ids take 55, AWS's 40; room for a prefix or two
REQUEST_ID: web.RequestKey[str] = web.RequestKey("request_id", str)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _is_printable_ascii(value: str) -> bool:
    return all(" " <= c <= "~" for c in value)


def request_id(request: web.Request) -> str:
    """The request's id: its valid X-Request-Id header, else a fresh one (kept for the response)."""
    if REQUEST_ID not in request:
        given = request.headers.getall(HEADER, [])
        valid = len(given) == 1 and _usable(given[0])
        request[REQUEST_ID] = given[0].strip() if valid else uuid.uuid4().hex
    return request[REQUEST_ID]


def _usable(value: str) -> bool:
    value = value.strip()
    return 0 < len(value) <= MAX_REQUEST_ID_CHARS and _is_printable_ascii(value)


@web.middleware
async def check_request_id(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuses (400) an X-Request-Id that cannot be echoed as it is; notes the id in the access log."""
    given = request.headers.getall(HEADER, [])
    rid = request_id(request)
    request[RECORD]["x_request_id"] = rid
    if len(given) > 1:
        raise invalid(f"the {HEADER} header must be given at most once")
    if given and given[0].strip() and not _usable(given[0]):
        message = f"the {HEADER} header must be at most {MAX_REQUEST_ID_CHARS} printable ASCII characters"
        raise invalid(message)
    return await handler(request)


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: every response carries the request's id, set before its headers go out."""
    response.headers[HEADER] = request_id(request)
