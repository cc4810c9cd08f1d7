"""The aiohttp application: routes, the error and access-log middleware, the API key check, the small
endpoints, and the drain that SIGTERM starts.

With API keys set (api/auth.py), every route but /health and /metrics needs `Authorization: Bearer <key>`:
/health is what load balancers and supervisors probe, and /metrics is what Prometheus scrapes, as in vLLM
(neither shows a prompt or a completion). Keep the port off untrusted networks if /metrics should be
private.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from pagedserve.api.auth import AUTH, TENANT, Auth, bearer_key
from pagedserve.api.cors import add_cors
from pagedserve.api.dashboard import add_dashboard, is_dashboard_path
from pagedserve.api.errors import ApiError, error_body, unauthorized
from pagedserve.api.handlers import chat_completions, completions, dumps
from pagedserve.api.limits import install as install_limits
from pagedserve.api.messages import add_routes as add_messages_routes
from pagedserve.api.messages import error_response as anthropic_error
from pagedserve.api.messages import is_messages_path
from pagedserve.api.model import INFO_TIMEOUT_S, ModelState
from pagedserve.api.render import add_routes as add_render_routes
from pagedserve.api.request_id import check_request_id, echo_request_id
from pagedserve.api.responses import add_routes as add_responses_routes
from pagedserve.api.state import RECORD, STATE, ApiState
from pagedserve.api.tokenization import add_routes as add_tokenization_routes
from pagedserve.api.version import version
from pagedserve.client import AsyncEngineClient, RequestRejected
from pagedserve.common.config import ApiConfig
from pagedserve.common.log import get_logger
from pagedserve.common.messages import ErrorKind

log = get_logger(component="api")
GENERATION_ROUTES = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
OPEN_PATHS = {"/health", "/metrics"}  # answered without the API key
PROBE_PATHS = {"/health", "/metrics"}  # logged at debug: probes would drown the access log
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(text=dumps(body), status=status, content_type="application/json")


def _error(e: ApiError, request: web.Request) -> web.Response:
    """The error in the API's own shape: Anthropic's on /v1/messages, OpenAI's elsewhere."""
    return anthropic_error(e) if is_messages_path(request.path) else e.to_response()


def _http_error(e: web.HTTPException, request: web.Request) -> web.Response:
    if e.status == 404:
        message = f"Invalid URL ({request.method} {request.path})"
    else:
        message = e.text or e.reason
    if is_messages_path(request.path):
        return anthropic_error(ApiError(e.status, message))
    kind = ErrorKind.INVALID_REQUEST if e.status < 500 else ErrorKind.INTERNAL
    return _json(error_body(message, kind), e.status)


@web.middleware
async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns errors into OpenAI error bodies, counts requests, and logs one access line per request (at
    debug for /health and /metrics): route, status, latency, tokens, and the error message of a 4xx/5xx."""
    start = time.perf_counter()
    record: dict[str, object] = {}
    request[RECORD] = record
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except ApiError as e:
        status = e.status
        record["error"] = e.message
        return _error(e, request)
    except web.HTTPException as e:
        status = e.status
        if status < 400:
            raise
        response = _http_error(e, request)
        record["error"] = e.text or e.reason
        return response
    except asyncio.CancelledError:
        record["outcome"] = "client_disconnected"
        raise
    except Exception as e:
        log.exception("unhandled_error", path=request.path)
        record["error"] = f"internal error: {type(e).__name__}"
        return _error(ApiError(500, "internal error", type=ErrorKind.INTERNAL), request)
    finally:
        if record.get("outcome") == "client_disconnected":
            status = 499  # nginx's "client closed request"
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "other"
        request.app[STATE].requests_total[(route, status)] += 1
        latency = round(time.perf_counter() - start, 4)
        emit = log.debug if request.path in PROBE_PATHS else log.info
        emit("request", method=request.method, route=route, status=status, latency_s=latency, **record)


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """With API keys configured, refuses (401, or 429 after too many wrong keys: api/auth.py) any request
    but the open paths without `Bearer <key>`, and marks the request with its key's tenant."""
    auth = request.app[AUTH]
    if auth.keys.enabled and request.path not in OPEN_PATHS and not is_dashboard_path(request.path):
        key = bearer_key(request)  # the dashboard makes its own check (a cookie or this)
        if key is None:
            raise unauthorized(given=False)
        request[TENANT] = tenant = auth.check(request, key)
        request[RECORD]["key"] = tenant.name  # the key's name on the access line, never the key
    return await handler(request)


async def health(request: web.Request) -> web.Response:
    """200 once the scheduler is ready (and the tokenizer loaded); 503 before, when it does not answer, or
    when the api's --model cannot serve the worker ("misconfigured": no tokenizer there, the worker serves
    another checkpoint, or the scheduler is another server instance's)."""
    state = request.app[STATE]
    if state.draining:
        return _json({"status": "shutting down", "reason": "the server is shutting down"}, 503)
    if state.client.connected:
        state.scheduler_reached = True
    elif state.scheduler_reached:  # it was up and its connection closed: no round trip to wait out
        return _json({"status": "unavailable", "reason": "the scheduler is not reachable"}, 503)
    try:
        info = await state.client.info(timeout=INFO_TIMEOUT_S)
    except TimeoutError:
        return _json({"status": "unavailable", "reason": "the scheduler does not answer"}, 503)
    foreign = state.models.foreign_scheduler(info)
    if foreign:
        return _json({"status": "misconfigured", "reason": foreign}, 503)
    if not info.ready:
        return _json({"status": "starting", "reason": "no worker is ready yet"}, 503)
    state.models.check(info)
    try:
        await state.models.get()
    except ApiError as e:
        status = "misconfigured" if state.models.misconfiguration else "starting"
        return _json({"status": status, "reason": e.message}, 503)
    return _json({"status": "ok"})


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    model = await state.models.serving()
    entry = {
        "id": model.name,
        "object": "model",
        "created": state.started,
        "owned_by": "pagedserve",
        "root": model.root,
        "parent": None,
        "max_model_len": model.max_model_len,
    }
    wanted = request.match_info.get("model")
    if wanted is None:
        return _json({"object": "list", "data": [entry]})
    if wanted != model.name:
        raise ApiError(404, f"The model `{wanted}` does not exist.", param="model", code="model_not_found")
    return _json(entry)


async def metrics(request: web.Request) -> web.Response:
    """The scheduler's Prometheus metrics, followed by the api's own."""
    state = request.app[STATE]
    try:
        info = await state.client.info(timeout=INFO_TIMEOUT_S)
    except TimeoutError:
        raise ApiError(503, "the scheduler does not answer", type=ErrorKind.UNAVAILABLE) from None
    text = info.metrics_text.rstrip("\n") + "\n" if info.metrics_text else ""
    return web.Response(
        body=(text + state.metrics_text()).encode(), headers={"Content-Type": PROMETHEUS_CONTENT_TYPE}
    )


async def drain(app: web.Application, timeout_s: float, grace_s: float = 5.0) -> int:
    """Stops admission (generation requests get 503, /health says "shutting down"), waits up to
    `timeout_s` for the requests in flight, then ends the rest: streams with an error event and [DONE],
    others with a 503. Returns how many had to be ended."""
    state = app[STATE]
    state.draining = True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    ended = list(state.in_flight)
    for generation in ended:
        generation.interrupt(RequestRejected(ErrorKind.UNAVAILABLE, "the server is shutting down"))
    deadline = loop.time() + grace_s  # their handlers write the error; a client that reads nothing is cut
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(0.05)
    return len(ended)


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    await state.client.start()
    warm_up = asyncio.create_task(state.models.warm_up(), name="api-model-warm-up")
    yield
    warm_up.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await warm_up
    await state.client.close()  # aborts whatever is still running
    state.tokenizer_pool.shutdown(wait=False, cancel_futures=True)


def create_app(config: ApiConfig, client: AsyncEngineClient | None = None) -> web.Application:
    """The HTTP app for `config`; `client` replaces the scheduler connection it would make (tests)."""
    client = client or AsyncEngineClient(
        config.scheduler_address,
        config.model or None,  # the api's checkpoint: its tokenizer loads from here, no worker needed
        cluster_key_file=config.cluster_key_file,
        liveness_timeout_s=config.scheduler_timeout_s,
    )
    middlewares = [observe, check_request_id, authenticate]
    app = web.Application(middlewares=middlewares, client_max_size=config.max_request_bytes)
    app.on_response_prepare.append(echo_request_id)
    add_cors(app, config)  # preflights answered before the API key; origin headers on every response
    app[STATE] = ApiState(config, client, ModelState(config, client))
    app[AUTH] = Auth(config)  # reads --api-key-file: KeyFileError when it is unusable
    install_limits(app, config, frozenset(OPEN_PATHS))  # connection deadlines and cap (api/limits.py)
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    add_tokenization_routes(app)
    add_responses_routes(app)  # /v1/responses (api/responses/)
    add_messages_routes(app)  # /v1/messages, Anthropic's (api/messages/)
    add_render_routes(app)  # what routers ask of a replica (api/render.py)
    if config.dashboard:
        add_dashboard(app)  # /dashboard (api/dashboard.py)
    return app
