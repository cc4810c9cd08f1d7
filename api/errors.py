"""HTTP errors with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from pagedserve.client import RequestRejected
from pagedserve.common.messages import ErrorKind

STATUS_BY_KIND = {ErrorKind.INVALID_REQUEST: 400, ErrorKind.UNAVAILABLE: 503, ErrorKind.INTERNAL: 500}


def error_body(
    message: str, type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ApiError(Exception):
    """An error to answer with: raised anywhere below a handler, turned into a response by the middleware."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = ErrorKind.INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def to_response(self) -> web.Response:
        return web.json_response(self.body(), status=self.status, dumps=json.dumps, headers=self.headers)

    @classmethod
    def from_rejection(cls, e: RequestRejected) -> ApiError:
        """The HTTP answer to a request the scheduler (or the client library) refused."""
        return cls(STATUS_BY_KIND.get(e.kind, 500), e.message, type=e.kind)


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    """A 400 for a request that can never be served as sent."""
    return ApiError(400, message, param=param, code=code)


def unauthorized(given: bool) -> ApiError:
    """OpenAI's 401 bodies, word for word but for the key itself, which is never echoed."""
    if not given:
        message = (
            "You didn't provide an API key. You need to provide your API key in an Authorization header "
            "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
        )
        return ApiError(401, message, headers={"WWW-Authenticate": "Bearer"})
    return ApiError(
        401, "Incorrect API key provided.", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
    )


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, type=ErrorKind.UNAVAILABLE)
