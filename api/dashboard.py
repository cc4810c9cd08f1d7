"""/dashboard: the KV cache's live view (docs/dashboard.md), relayed from the scheduler's snapshots.

Routes (all under /dashboard; none when ApiConfig.dashboard is off):
    GET  /dashboard                  the page (api/static/dashboard/), or the sign-in form when a key is set
    POST /dashboard/login            the form's key -> a session cookie, then back to the page
    GET  /dashboard/events           server-sent events: one `data: <snapshot JSON>` per snapshot
    GET  /dashboard/snapshot         one snapshot as JSON (?cells=N), for scripts and curl
    GET  /dashboard/static/NAME      the page's script, style and the vendored Chart.js

Authentication. With an api_key, every route but the sign-in needs the key, as `Authorization: Bearer` (for
programs) or as the session cookie the sign-in form sets: a browser's EventSource sends no headers, and a key
in the URL would sit in access logs and history. The cookie holds HMAC-SHA256(api_key, a fixed label), never
the key itself, is HttpOnly and SameSite=Strict, and is valid as long as the key is.

One poller per api process asks the scheduler for a snapshot every PERIOD_S while at least one browser
holds an event stream open, and stops with the last; every stream gets the latest snapshot (a stream that
reads slowly skips snapshots, it never queues them), and at most MAX_VIEWERS streams are open at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
from pathlib import Path

from aiohttp import web

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
COOKIE_MAX_AGE_S = 12 * 3600
PERIOD_S = 0.5  # a snapshot per viewer stream at most this often (the scheduler caches its own as well)
DEFAULT_CELLS = 4096
MAX_VIEWERS = 32
SNAPSHOT_TIMEOUT_S = 2.0
KEEPALIVE_S = 15.0  # a comment line this often keeps proxies from closing an idle stream


def is_dashboard_path(path: str) -> bool:
    """Paths whose authentication is this module's (cookie or bearer), not the api's bearer-only check."""
    return path == PREFIX or path.startswith(PREFIX + "/")


def session_token(api_key: str) -> str:
    return hmac.new(api_key.encode(), b"pagedserve dashboard session", hashlib.sha256).hexdigest()


def _signed_in(request: web.Request) -> bool:
    key = request.app[STATE].config.api_key
    if not key:
        return True
    cookie = request.cookies.get(COOKIE, "")
    if cookie and hmac.compare_digest(cookie.encode(), session_token(key).encode()):
        return True
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    given = token.strip().encode("utf-8", "surrogatepass")
    return scheme.lower() == "bearer" and hmac.compare_digest(given, key.encode())


def _require(request: web.Request) -> None:
    if not _signed_in(request):
        raise unauthorized(given=bool(request.headers.get("Authorization") or request.cookies.get(COOKIE)))


def _login_page(message: str = "", status: int = 200) -> web.Response:
    html = (STATIC_DIR / "login.html").read_text().replace("{{message}}", message)
    return web.Response(text=html, status=status, content_type="text/html")


async def page(request: web.Request) -> web.StreamResponse:
    if not _signed_in(request):
        return _login_page(status=401)
    return web.FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-store"})


async def login(request: web.Request) -> web.Response:
    key = request.app[STATE].config.api_key
    form = await request.post()
    given = str(form.get("key", ""))[:4096].encode("utf-8", "surrogatepass")
    if key and not hmac.compare_digest(given, key.encode()):
        log.info("dashboard_sign_in_refused", remote=request.remote)
        return _login_page("That key is not the server's API key.", status=401)
    response = web.Response(status=303, headers={"Location": PREFIX})
    if key:
        response.set_cookie(
            COOKIE, session_token(key), max_age=COOKIE_MAX_AGE_S, path=PREFIX, httponly=True,
            samesite="Strict", secure=request.secure,
        )  # fmt: skip
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
            if not event:
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
    app.on_shutdown.append(app[VIEWERS].close)
    app.router.add_get(PREFIX, page)
    app.router.add_post(PREFIX + "/login", login)
    app.router.add_get(PREFIX + "/events", events)
    app.router.add_get(PREFIX + "/snapshot", snapshot)
    app.router.add_get(PREFIX + "/static/{name}", static)
