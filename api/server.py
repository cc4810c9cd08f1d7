"""The aiohttp application: routes, the error and request-log middleware, and the small endpoints."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web

from api.errors import ApiError, error_body
from api.handlers import chat_completions, completions, dumps
from api.model import INFO_TIMEOUT_S, ModelState
from api.state import RECORD, STATE, ApiState
from common.client import AsyncEngineClient
from common.config import ApiConfig
from common.log import get_logger
from common.messages import ErrorKind

log = get_logger(component="api")
GENERATION_ROUTES = {"/v1/completions", "/v1/chat/completions"}
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: object, status: int = 200) -> web.Response:
    return web.Response(text=dumps(body), status=status, content_type="application/json")


def _http_error(e: web.HTTPException, request: web.Request) -> web.Response:
    if e.status == 404:
        message = f"Invalid URL ({request.method} {request.path})"
    else:
        message = e.text or e.reason
    kind = ErrorKind.INVALID_REQUEST if e.status < 500 else ErrorKind.INTERNAL
    return _json(error_body(message, kind), e.status)


@web.middleware
async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Turns errors into OpenAI error bodies, counts requests, and logs one line per generation request."""
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
        return e.to_response()
    except web.HTTPException as e:
        status = e.status
        if status < 400:
            raise
        return _http_error(e, request)
    except asyncio.CancelledError:
        record["outcome"] = "client_disconnected"
        raise
    except Exception:
        log.exception("unhandled_error", path=request.path)
        return ApiError(500, "internal error", type=ErrorKind.INTERNAL).to_response()
    finally:
        if record.get("outcome") == "client_disconnected":
            status = 499  # nginx's "client closed request"
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "other"
        request.app[STATE].requests_total[(route, status)] += 1
        latency = round(time.perf_counter() - start, 4)
        emit = log.info if route in GENERATION_ROUTES else log.debug  # health checks would drown the rest
        emit("request", route=route, status=status, latency_s=latency, **record)


async def health(request: web.Request) -> web.Response:
    """200 once the scheduler is ready (and the tokenizer loaded), 503 before or when it does not answer."""
    state = request.app[STATE]
    try:
        info = await state.client.info(timeout=INFO_TIMEOUT_S)
    except TimeoutError:
        return _json({"status": "unavailable", "reason": "the scheduler does not answer"}, 503)
    if not info.ready:
        return _json({"status": "starting", "reason": "no worker is ready yet"}, 503)
    try:
        await state.models.get()
    except ApiError as e:
        return _json({"status": "starting", "reason": e.message}, 503)
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


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    state = app[STATE]
    await state.client.start()
    warm_up = asyncio.create_task(state.models.warm_up(), name="api-model-warm-up")
    yield
    warm_up.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await warm_up
    await state.client.close()  # aborts whatever is still running


def create_app(config: ApiConfig, client: AsyncEngineClient | None = None) -> web.Application:
    """The HTTP app for `config`; `client` replaces the scheduler connection it would make (tests)."""
    client = client or AsyncEngineClient(config.scheduler_address, config.model or None)
    app = web.Application(middlewares=[observe], client_max_size=config.max_request_bytes)
    app[STATE] = ApiState(config, client, ModelState(config, client))
    app.cleanup_ctx.append(_lifecycle)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
