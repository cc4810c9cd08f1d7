"""What one HTTP client may hold: deadlines for a connection's headers, body and idle time, and the cap on
connections with its reserve for /health and authenticated clients.

aiohttp has a keep-alive timeout and header size limits, but no deadline for a request's headers or body
and no cap on connections: sockets that each sent one byte held the process at its file-descriptor limit,
and a body trickled a byte at a time stayed open for good. Every accepted socket is wrapped here (Guarded,
a thin protocol in front of aiohttp's RequestHandler) so that ConnectionGuard sees it open, receive bytes
and close; the `admit` middleware, the innermost, so after the API key check, sees its requests begin and
end. A sweep a few times a second enforces each connection's deadline:

phase    from                                  until                  deadline
headers  accept, or the first byte after idle  a request's headers    header_timeout_s (1 s past the soft cap)
body     the request's headers                 its body read in full  body_timeout_s: 408, then closed
busy     its body read                         the handler's end      none (streams: stream_write_timeout_s)
idle     the handler's end                     the next byte          keepalive_timeout_s

The cap: at max_connections (held under the file-descriptor limit), a new connection displaces the one
that has waited longest without holding a request (busy), connections that never passed the API key check
first; when every connection is busy, the new one is closed. Past the soft cap (max_connections minus
connection_reserve) new connections have PRESSURE_HEADER_TIMEOUT_S to send their headers, a connection
that has not passed the key check is closed after its answer, and once the soft cap's worth of requests
are in progress, routes other than the reserved ones (/health, /metrics) answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import cast

from aiohttp import web
from aiohttp.web_protocol import RequestHandler

from pagedserve.api.errors import ApiError, unavailable
from pagedserve.common.config import ApiConfig
from pagedserve.common.log import get_logger

log = get_logger(component="api.limits")
PRESSURE_HEADER_TIMEOUT_S = 1.0  # past the soft cap: a real client sends its headers in milliseconds
BODY_TIMEOUT_GRACE_S = 1.0  # a body that timed out has this long to be answered 408 before the cut
FD_HEADROOM = 128  # descriptors kept for what is not an HTTP connection: ZeroMQ, logs, the tokenizer
SWEEP_MIN_S, SWEEP_MAX_S = 0.05, 0.25
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def fd_budget() -> int:
    """The connections the process's file-descriptor limit leaves room for; the soft limit is raised to
    the hard one first (as servers do), so the budget is what the operator allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
    return (1 << 30) if soft == resource.RLIM_INFINITY else max(1, soft - FD_HEADROOM)


@dataclass(eq=False)
class Connection:
    """One client connection as the guard sees it."""

    transport: asyncio.Transport
    phase: str  # headers, body, busy, idle or closing (see the module's table)
    deadline: float | None  # loop time at which the connection is closed; None: none
    trusted: bool = False  # has sent a request that passed the API key check
    request: web.BaseRequest | None = None  # the request in progress (body and busy)


class ConnectionGuard:
    """The one owner of the table of open connections, their phases and deadlines."""

    def __init__(self, config: ApiConfig, reserved_paths: frozenset[str]) -> None:
        self.config = config
        self.reserved_paths = reserved_paths
        self.max_connections = min(config.max_connections, fd_budget())
        self.soft_cap = max(1, self.max_connections - config.connection_reserve)
        # Connections that hold no request, in the order they would be displaced (oldest first in each):
        # those that never passed the key check, then the others; busy ones are never displaced.
        self._untrusted: OrderedDict[asyncio.Transport, Connection] = OrderedDict()
        self._trusted: OrderedDict[asyncio.Transport, Connection] = OrderedDict()
        self._busy: dict[asyncio.Transport, Connection] = {}
        self.in_progress = 0  # requests between admit's entry and exit
        self.closed = Counter[str]()  # why connections were closed by the guard: header_timeout, ...
        self._sweeper: asyncio.Task[None] | None = None
        timeouts = (config.header_timeout_s, config.body_timeout_s, config.keepalive_timeout_s)
        self._sweep_s = min(SWEEP_MAX_S, max(SWEEP_MIN_S, min(timeouts) / 4))

    @property
    def num_connections(self) -> int:
        return len(self._untrusted) + len(self._trusted) + len(self._busy)

    def protocol_factory(self, server: web.Server) -> Guarded:
        return Guarded(self, server())

    def start(self) -> None:
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(self._sweep(), name="api-connection-sweep")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
            self._sweeper = None

    # -- the connection's events (Guarded) ----------------------------------------------------------------

    def opened(self, transport: asyncio.Transport) -> bool:
        """Registers a new connection; False when it must be closed (every connection holds a request)."""
        if self.num_connections >= self.max_connections and not self._displace():
            self.closed["cap"] += 1
            return False
        now = asyncio.get_running_loop().time()
        pressed = self.num_connections >= self.soft_cap
        timeout = min(self.config.header_timeout_s, PRESSURE_HEADER_TIMEOUT_S) if pressed else None
        deadline = now + (timeout or self.config.header_timeout_s)
        self._untrusted[transport] = Connection(transport, "headers", deadline)
        return True

    def received(self, transport: asyncio.Transport) -> None:
        conn = self._find(transport)
        if conn is not None and conn.phase == "idle":  # the next request begins: its headers are due
            conn.phase = "headers"
            conn.deadline = asyncio.get_running_loop().time() + self.config.header_timeout_s

    def lost(self, transport: asyncio.Transport) -> None:
        self._remove(transport)

    # -- the requests (admit) -----------------------------------------------------------------------------

    def request_started(self, request: web.BaseRequest) -> Connection | None:
        transport = request.transport
        conn = self._remove(transport) if transport is not None else None
        if conn is None:  # already closed or displaced
            return None
        conn.trusted, conn.request = True, request
        self.in_progress += 1
        if request.content.is_eof():  # a GET, or a body that came with its headers: busy at once
            conn.phase, conn.deadline = "busy", None
            self._busy[conn.transport] = conn
        else:
            conn.phase = "body"
            conn.deadline = asyncio.get_running_loop().time() + self.config.body_timeout_s
            self._trusted[conn.transport] = conn
        return conn

    def request_ended(self, conn: Connection) -> None:
        self.in_progress -= 1
        if self._remove(conn.transport) is None:
            return
        if conn.phase == "closing":  # the sweep cuts it at its deadline
            self._trusted[conn.transport] = conn
            return
        conn.request, conn.phase = None, "idle"
        conn.deadline = asyncio.get_running_loop().time() + self.config.keepalive_timeout_s
        self._trusted[conn.transport] = conn

    async def on_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """Past the soft cap, an untrusted connection (401s, bad requests) is closed after its answer; a
        body that timed out closes its connection."""
        conn = self._find(request.transport) if request.transport is not None else None
        if conn is None:
            return
        if conn.phase == "closing" or (not conn.trusted and self.num_connections >= self.soft_cap):
            response.force_close()
            response.headers["Connection"] = "close"  # the headers are made before this hook runs

    # -- internals ------------------------------------------------------------------------------------------

    def _find(self, transport: asyncio.Transport) -> Connection | None:
        return self._untrusted.get(transport) or self._trusted.get(transport) or self._busy.get(transport)

    def _remove(self, transport: asyncio.Transport) -> Connection | None:
        for table in (self._untrusted, self._trusted, self._busy):
            conn = table.pop(transport, None)
            if conn is not None:
                return conn
        return None

    def _displace(self) -> bool:
        """Closes the connection that has waited longest without a request in progress; False if none."""
        for table in (self._untrusted, self._trusted):
            if table:
                transport, conn = table.popitem(last=False)
                self.closed["displaced"] += 1
                log.debug("connection_displaced", phase=conn.phase, trusted=conn.trusted)
                transport.abort()
                return True
        return False

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._sweep_s)
            now = loop.time()
            for table in (self._untrusted, self._trusted):
                for conn in list(table.values()):
                    self._check(conn, now)

    def _check(self, conn: Connection, now: float) -> None:
        if conn.phase == "body" and conn.request is not None and conn.request.content.is_eof():
            conn.phase, conn.deadline = "busy", None  # the body is in: from here the handler's limits hold
            self._busy[conn.transport] = self._trusted.pop(conn.transport)
            return
        if conn.deadline is None or now < conn.deadline:
            return
        if conn.phase == "body" and conn.request is not None:
            # Answer 408 in the API's error shape, then cut the connection if the answer is not out soon.
            message = f"the request body did not arrive within {self.config.body_timeout_s} s"
            conn.request.content.set_exception(ApiError(408, message, code="body_timeout"))
            conn.phase, conn.deadline = "closing", now + BODY_TIMEOUT_GRACE_S
            self.closed["body_timeout"] += 1
            log.info("http_body_timeout", timeout_s=self.config.body_timeout_s)
            return
        if conn.phase == "headers":
            self.closed["header_timeout"] += 1
        elif conn.phase == "idle":
            self.closed["keepalive_timeout"] += 1
        self._remove(conn.transport)
        conn.transport.abort()


class Guarded(asyncio.Protocol):
    """aiohttp's RequestHandler behind the guard: each event goes to the guard, then to the handler."""

    def __init__(self, guard: ConnectionGuard, handler: RequestHandler) -> None:
        self._guard = guard
        self._handler = handler
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport = cast(asyncio.Transport, transport)
        if not self._guard.opened(transport):
            transport.abort()
            return
        self._transport = transport
        self._handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._transport is not None:
            self._guard.received(self._transport)
            self._handler.data_received(data)

    def eof_received(self) -> bool | None:
        return self._handler.eof_received() if self._transport is not None else None

    def pause_writing(self) -> None:
        self._handler.pause_writing()

    def resume_writing(self) -> None:
        self._handler.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is not None:
            self._guard.lost(self._transport)
            self._handler.connection_lost(exc)


GUARD = web.AppKey("connection_guard", ConnectionGuard)


@web.middleware
async def admit(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Marks the request's connection busy (so never displaced) while the request runs; past the soft cap
    of requests in progress, only the reserved routes are served."""
    guard = request.app[GUARD]
    conn = guard.request_started(request)
    try:
        if guard.in_progress > guard.soft_cap and request.path not in guard.reserved_paths:
            raise unavailable("the server holds too many connections; retry later")
        return await handler(request)
    finally:
        if conn is not None:
            guard.request_ended(conn)


def install(app: web.Application, config: ApiConfig, reserved_paths: frozenset[str]) -> None:
    """Gives `app` its guard; call after the other middlewares are set, so that `admit` runs after the
    API key check."""
    guard = ConnectionGuard(config, reserved_paths)
    app[GUARD] = guard
    app.middlewares.append(admit)
    app.on_response_prepare.append(guard.on_prepare)


class GuardedSite(web.BaseSite):
    """A TCP listener (host and port, or a bound socket) whose connections go through the app's guard."""

    def __init__(
        self, runner: web.AppRunner, host: str = "", port: int = 0, sock: socket.socket | None = None
    ) -> None:
        super().__init__(runner, backlog=1024)
        self._host, self._port, self._sock = host, port, sock

    @property
    def name(self) -> str:
        return f"http://{self._host}:{self._port}"

    async def start(self) -> None:
        await super().start()
        server, guard = self._runner.server, self._runner.app[GUARD]  # type: ignore[attr-defined]
        assert server is not None
        loop = asyncio.get_running_loop()
        factory = lambda: guard.protocol_factory(server)  # noqa: E731
        if self._sock is not None:
            self._server = await loop.create_server(factory, sock=self._sock, backlog=self._backlog)
        else:
            self._server = await loop.create_server(factory, self._host, self._port, backlog=self._backlog)
        guard.start()

    async def stop(self) -> None:
        await self._runner.app[GUARD].stop()  # type: ignore[attr-defined]
        await super().stop()


async def start_server(
    app: web.Application, config: ApiConfig, sock: socket.socket | None = None
) -> web.AppRunner:
    """Runs `app` on config's host and port (or on `sock`) with the HTTP limits; cleanup() stops it."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that hangs up cancels its handler, which aborts its requests
        access_log=None,  # the observe middleware logs each request
        shutdown_timeout=2.0,  # drain() has already waited; what still runs after it is cancelled soon
        keepalive_timeout=config.keepalive_timeout_s,
        lingering_time=BODY_TIMEOUT_GRACE_S,  # an unread body after the answer is drained this long at most
    )
    await runner.setup()
    try:
        await GuardedSite(runner, config.host, config.port, sock).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
