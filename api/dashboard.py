"""/dashboard: the KV cache's live view (docs/dashboard.md), relayed from the scheduler's snapshots.

Routes (all under /dashboard; none when ApiConfig.dashboard is off):
    GET  /dashboard                  the page (api/static/dashboard/), or the sign-in form when a key is set
    POST /dashboard/login            the form's key -> a session cookie, then back to the page
    POST /dashboard/logout           ends the cookie's session, then back to the page (the sign-in form)
    GET  /dashboard/events           server-sent events: one `data: <snapshot JSON>` per snapshot
    GET  /dashboard/snapshot         one snapshot as JSON (?cells=N), for scripts and curl
    GET  /dashboard/static/NAME      the page's script, style and the vendored Chart.js

Authentication. With API keys (api/auth.py), every route but the sign-in and sign-out needs a key, as
`Authorization: Bearer` (for programs) or as the session cookie the sign-in form sets: a browser's
EventSource sends no headers, and a key in the URL would sit in access logs and history. The cookie holds a
random token of this process's session table (Sessions), never the key nor anything derived from it; it is
HttpOnly and SameSite=Strict. A session ends at its expiry (SESSION_TTL_S), at sign-out, when the key that
opened it leaves the key file, or when the api restarts; an event stream open under it ends with it. Wrong
keys at the sign-in count towards the address's throttle as the api's do.

One poller per api process asks the scheduler for a snapshot every PERIOD_S while at least one browser
holds an event stream open, and stops with the last; every stream gets the latest snapshot (a stream that
reads slowly skips snapshots, it never queues them), and at most MAX_VIEWERS streams are open at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

from pagedserve.api.auth import AUTH, Tenant, bearer_key
from pagedserve.api.errors import ApiError, unauthorized, unavailable
from pagedserve.api.state import STATE
from pagedserve.common.kv_view import snapshot_json
from pagedserve.common.log import get_logger
from pagedserve.common.messages import MAX_SNAPSHOT_CELLS

log = get_logger(component="api")

PREFIX = "/dashboard"
STATIC_DIR = Path(__file__).parent / "static" / "dashboard"
STATIC_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".txt": "text/plain"}
COOKIE = "pagedserve_dashboard"
SESSION_TTL_S = 12 * 3600
MAX_SESSIONS = 1024  # signed-in browsers; past it, the oldest session ends
PERIOD_S = 0.5  # a snapshot per viewer stream at most this often (the scheduler caches its own as well)
DEFAULT_CELLS = 4096
MAX_VIEWERS = 32
SNAPSHOT_TIMEOUT_S = 2.0
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream


def is_dashboard_path(path: str) -> bool:
    """Paths whose authentication is this module's (cookie or bearer), not the api's bearer-only check."""
    return path == PREFIX or path.startswith(PREFIX + "/")


class Sessions:
    """Dashboard sign-ins: random tokens, each with the tenant that signed in and an expiry; at most
    `max_sessions` (the oldest ends first). Only a token's SHA-256 is kept, so the table shows no cookie."""

    def __init__(
        self, max_sessions: int = MAX_SESSIONS, ttl_s: float = SESSION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._open: OrderedDict[bytes, tuple[Tenant, float]] = OrderedDict()  # -> (tenant, expiry)

    @staticmethod
    def _id(token: str) -> bytes:
        return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()

    def open(self, tenant: Tenant) -> str:
        """A new session's token (the cookie's value)."""
        now = self._clock()
        for sid, (_, expiry) in list(self._open.items()):
            if expiry <= now:
                del self._open[sid]
        while len(self._open) >= self.max_sessions:
            self._open.popitem(last=False)
        token = secrets.token_urlsafe(32)
        self._open[self._id(token)] = (tenant, now + self.ttl_s)
        return token

    def find(self, token: str) -> Tenant | None:
        """The tenant of a live session, or None (none, expired or revoked)."""
        sid = self._id(token)
        entry = self._open.get(sid)
        if entry is None or entry[1] <= self._clock():
            self._open.pop(sid, None)
            return None
        return entry[0]

    def revoke(self, token: str) -> None:
        self._open.pop(self._id(token), None)

    def __len__(self) -> int:
        return len(self._open)


SESSIONS = web.AppKey("dashboard_sessions", Sessions)


def _session_alive(request: web.Request) -> bool:
    """Whether the request's cookie names a live session whose key still opens the api (a session whose
    key was removed is ended here)."""
    token = request.cookies.get(COOKIE, "")[:256]
    if not token:
        return False
    tenant = request.app[SESSIONS].find(token)
    if tenant is None:
        return False
    if not request.app[AUTH].keys.holds(tenant):
        request.app[SESSIONS].revoke(token)
        return False
    return True


def _signed_in(request: web.Request) -> bool:
    """A live session or a right bearer key (a wrong one raises 401, or 429 past the address's throttle)."""
    auth = request.app[AUTH]
    if not auth.keys.enabled or _session_alive(request):
        return True
    key = bearer_key(request)
    if key is None:
        return False
    auth.check(request, key)
    return True


def _still_signed_in(request: web.Request) -> bool:
    """For an open event stream: its session or key still valid (checked as each event goes out)."""
    auth = request.app[AUTH]
    if not auth.keys.enabled or _session_alive(request):
        return True
    key = bearer_key(request)
    return key is not None and auth.keys.match(key) is not None


def _require(request: web.Request) -> None:
    if not _signed_in(request):
        raise unauthorized(given=bool(request.cookies.get(COOKIE)))


def _login_page(message: str = "", status: int = 200) -> web.Response:
    html = (STATIC_DIR / "login.html").read_text().replace("{{message}}", message)
    return web.Response(text=html, status=status, content_type="text/html")


async def page(request: web.Request) -> web.StreamResponse:
    try:
        signed_in = _signed_in(request)
    except ApiError as e:  # a wrong bearer key: 401, or 429 with its Retry-After
        refused = _login_page(e.message, status=e.status)
        refused.headers.update(e.headers or {})
        return refused
    if not signed_in:
        return _login_page(status=401)
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})


async def login(request: web.Request) -> web.Response:
    auth = request.app[AUTH]
    form = await request.post()
    given = str(form.get("key", ""))[:4096].encode("utf-8", "surrogatepass")
    response = web.Response(status=303, headers={"Location": PREFIX})
    if auth.keys.enabled:
        try:
            tenant = auth.check(request, given)
        except ApiError as e:
            log.info("dashboard_sign_in_refused", remote=request.remote, status=e.status)
            message = "That key does not open this server." if e.status == 401 else e.message
            refused = _login_page(message, status=e.status)
            refused.headers.update(e.headers or {})
            return refused
        response.set_cookie(
            COOKIE, request.app[SESSIONS].open(tenant), max_age=SESSION_TTL_S, path=PREFIX, httponly=True,
            samesite="Strict", secure=request.secure,
        )  # fmt: skip
    return response


async def logout(request: web.Request) -> web.Response:
    """Ends the cookie's session (a token that names none changes nothing)."""
    token = request.cookies.get(COOKIE, "")[:256]
    if token:
        request.app[SESSIONS].revoke(token)
    response = web.Response(status=303, headers={"Location": PREFIX})
    response.del_cookie(COOKIE, path=PREFIX)
    return response


async def static(request: web.Request) -> web.StreamResponse:
    _require(request)
    name = request.match_info["name"]
    path = STATIC_DIR / name
    # Only the folder's own plain files: no "..", no hidden files, no other folders.
    if "/" in name or name.startswith(".") or Path(name).suffix not in STATIC_TYPES or not path.is_file():
        raise ApiError(404, f"Invalid URL (GET {request.path})")
    return web.FileResponse(path, headers={"Content-Type": STATIC_TYPES[path.suffix]})


def _cells(request: web.Request) -> int:
    text = request.query.get("cells", str(DEFAULT_CELLS))
    if not text.isdigit() or not 1 <= int(text) <= MAX_SNAPSHOT_CELLS:
        raise ApiError(400, f"cells must be an integer in [1, {MAX_SNAPSHOT_CELLS}]", param="cells")
    return int(text)


async def snapshot(request: web.Request) -> web.Response:
    _require(request)
    try:
        snap = await request.app[STATE].client.kv_snapshot(_cells(request), SNAPSHOT_TIMEOUT_S)
    except TimeoutError:
        raise unavailable("the scheduler does not answer") from None
    return web.Response(body=snapshot_json(snap), content_type="application/json")


class Viewers:
    """The open event streams and the one poller that feeds them while there is any."""

    def __init__(self) -> None:
        self._streams: set[asyncio.Queue[bytes]] = set()
        self._poller: asyncio.Task[None] | None = None
        self.closed = False

    def join(self, app: web.Application) -> asyncio.Queue[bytes]:
        if len(self._streams) >= MAX_VIEWERS:
            raise unavailable(f"{MAX_VIEWERS} dashboards are open; close one and retry")
        queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=1)
        self._streams.add(queue)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll(app), name="api-dashboard-poller")
        return queue

    def leave(self, queue: asyncio.Queue[bytes]) -> None:
        self._streams.discard(queue)

    def _publish(self, event: bytes) -> None:
        for queue in self._streams:
            if queue.full():  # a slow reader gets the latest snapshot, not a backlog
                queue.get_nowait()
            queue.put_nowait(event)

    async def _poll(self, app: web.Application) -> None:
        client = app[STATE].client
        while self._streams and not self.closed:
            try:
                snap = await client.kv_snapshot(DEFAULT_CELLS, SNAPSHOT_TIMEOUT_S)
                self._publish(b"data: " + snapshot_json(snap) + b"\n\n")
            except TimeoutError:
                self._publish(b'event: problem\ndata: "the scheduler does not answer"\n\n')
            except Exception:  # a bug here must not end the api; the streams see no new snapshot
                log.exception("dashboard_poll_failed")
            await asyncio.sleep(PERIOD_S)

    async def close(self, app: web.Application) -> None:
        """Ends every stream (the api is stopping) and the poller."""
        self.closed = True
        self._publish(b"")
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller


VIEWERS = web.AppKey("dashboard_viewers", Viewers)


async def events(request: web.Request) -> web.StreamResponse:
    _require(request)
    state = request.app[STATE]
    viewers = request.app[VIEWERS]
    queue = viewers.join(request.app)
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    )
    try:
        await response.prepare(request)
        while not viewers.closed and not state.draining:
            try:
                event = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
            except TimeoutError:
                event = b": keepalive\n\n"
            if not event or not _still_signed_in(request):  # signed out or revoked: the stream ends
                break
            # A browser that stops reading is cut, as a generation stream is (its socket's buffer is full).
            await asyncio.wait_for(response.write(event), state.config.stream_write_timeout_s)
    except (ConnectionResetError, TimeoutError):
        pass
    finally:
        viewers.leave(queue)
    return response


def add_dashboard(app: web.Application) -> None:
    """Adds the dashboard's routes to the api's app."""
    app[VIEWERS] = Viewers()
    app[SESSIONS] = Sessions()
    app.on_shutdown.append(app[VIEWERS].close)
    app.router.add_get(PREFIX, page)
    app.router.add_post(PREFIX + "/login", login)
    app.router.add_post(PREFIX + "/logout", logout)
    app.router.add_get(PREFIX + "/events", events)
    app.router.add_get(PREFIX + "/snapshot", snapshot)
    app.router.add_get(PREFIX + "/static/{name}", static)
