"""CORS, for web pages that call the api from another origin: vLLM's flags (--allowed-origins,
--allowed-methods, --allowed-headers, --allow-credentials, JSON lists) with the answers of the Starlette
middleware vLLM uses, in a small aiohttp middleware of our own (aiohttp-cors wants every route registered
with it, and would be one more dependency for ~80 lines).

A preflight (OPTIONS with Origin and Access-Control-Request-Method) is answered here, before the API key
is checked (browsers send no credentials with it): 200 with the allowed origin, methods, headers and a max
age of 600 s, or a 400 naming what is disallowed. Any other response to an allowed origin carries
Access-Control-Allow-Origin (and Vary: Origin, and Allow-Credentials when set), errors and streams included,
and exposes X-Request-Id and X-Ignored-Fields to the page (vLLM exposes none).

Unlike vLLM (any origin), the default allows only pages served from this machine (`http://localhost:*` and
the like): the server binds 127.0.0.1, where the one remote reader a wildcard would add is any web site the
local user visits. `--allowed-origins '["*"]'` is vLLM's default.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from pagedserve.api.errors import ApiError, invalid
from pagedserve.api.request_fields import IGNORED_FIELDS_HEADER
from pagedserve.common.config import ApiConfig, json_string_list

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")  # Starlette's, for "*"
SAFELISTED_HEADERS = ("Accept", "Accept-Language", "Content-Language", "Content-Type")
MAX_AGE_S = 600  # Starlette's: how long a browser may keep a preflight's answer
EXPOSED_HEADERS = f"X-Request-Id, {IGNORED_FIELDS_HEADER}"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class CorsPolicy:
    """Which origins, methods and request headers pages may use; from ApiConfig's JSON lists."""

    origins: frozenset[str]  # exact origins, e.g. "http://localhost:3000"
    any_port_of: tuple[str, ...]  # "scheme://host" of the "scheme://host:*" entries
    any_origin: bool
    methods: tuple[str, ...]
    headers: frozenset[str]  # lowercase
    any_header: bool
    credentials: bool

    @classmethod
    def from_config(cls, config: ApiConfig) -> CorsPolicy:
        origins = json_string_list("allowed_origins", config.allowed_origins)
        methods = json_string_list("allowed_methods", config.allowed_methods)
        headers = json_string_list("allowed_headers", config.allowed_headers)
        return cls(
            origins=frozenset(o for o in origins if not o.endswith(":*")),
            any_port_of=tuple(o[:-2] for o in origins if o.endswith(":*") and o != "*"),
            any_origin="*" in origins,
            methods=ALL_METHODS if "*" in methods else tuple(m.upper() for m in methods),
            headers=frozenset(h.lower() for h in (*headers, *SAFELISTED_HEADERS) if h != "*"),
            any_header="*" in headers,
            credentials=config.allow_credentials,
        )

    def allows_origin(self, origin: str) -> bool:
        if self.any_origin or origin in self.origins:
            return True
        for base in self.any_port_of:
            port = origin[len(base) + 1 :] if origin.startswith(base + ":") else None
            if origin == base or (port is not None and port.isdigit() and len(port) <= 5):
                return True
        return False

    def origin_headers(self, origin: str) -> dict[str, str]:
        """The headers every answer to an allowed origin carries."""
        if self.any_origin:  # never with credentials (ApiConfig refuses the pair)
            headers = {"Access-Control-Allow-Origin": "*"}
        else:
            headers = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if self.credentials:
            headers["Access-Control-Allow-Credentials"] = "true"
        return headers

    def preflight(self, request: web.Request) -> web.Response:
        """The answer to a preflight: 200 with what the page may send, or 400 naming what it may not."""
        origin = request.headers["Origin"]
        method = request.headers["Access-Control-Request-Method"].strip().upper()
        asked = request.headers.get("Access-Control-Request-Headers", "")
        names = [h.strip() for h in asked.split(",") if h.strip()]
        disallowed = []
        if not self.allows_origin(origin):
            disallowed.append("origin")
        if method not in self.methods:
            disallowed.append("method")
        if not self.any_header and any(h.lower() not in self.headers for h in names):
            disallowed.append("headers")
        if disallowed:  # Starlette's words, in our error body
            raise invalid(f"Disallowed CORS {', '.join(disallowed)}")
        headers = self.origin_headers(origin)
        headers["Access-Control-Allow-Methods"] = ", ".join(self.methods)
        headers["Access-Control-Max-Age"] = str(MAX_AGE_S)
        if self.any_header and names:  # the wildcard answers what was asked (credentials forbid a "*")
            headers["Access-Control-Allow-Headers"] = ", ".join(names)
        elif not self.any_header:
            headers["Access-Control-Allow-Headers"] = ", ".join(sorted(self.headers))
        return web.Response(text="OK", headers=headers)


CORS = web.AppKey("cors", CorsPolicy)


def _is_preflight(request: web.Request) -> bool:
    return (
        request.method == "OPTIONS"
        and "Origin" in request.headers
        and "Access-Control-Request-Method" in request.headers
    )


@web.middleware
async def answer_preflight(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: a preflight is answered before routing and the API key (a 400 body when disallowed)."""
    if not _is_preflight(request):
        return await handler(request)
    try:
        return request.app[CORS].preflight(request)
    except ApiError as e:  # outside the error middleware, which answers the others
        return e.to_response()


async def add_origin_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: an allowed origin may read the answer (and these headers of it)."""
    origin = request.headers.get("Origin")
    policy = request.app[CORS]
    if origin is None or _is_preflight(request) or not policy.allows_origin(origin):
        return
    headers = policy.origin_headers(origin)
    if "Vary" in headers and "Vary" in response.headers:  # the handler's own Vary stays
        headers["Vary"] = f"{response.headers['Vary']}, Origin"
    response.headers.update(headers)
    response.headers["Access-Control-Expose-Headers"] = EXPOSED_HEADERS


def add_cors(app: web.Application, config: ApiConfig) -> None:
    """Puts the preflight answer first among the app's middlewares and the headers on every response."""
    app[CORS] = CorsPolicy.from_config(config)
    app.middlewares.insert(0, answer_preflight)
    app.on_response_prepare.append(add_origin_headers)
