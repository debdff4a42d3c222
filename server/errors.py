"""The one table from error kind to HTTP status, OpenAI error `type` and
`Retry-After`, used for JSON error bodies and for SSE error events alike."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from engine_adapter.errors import (
    AuthenticationError,
    EngineError,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    NotFound,
    PermissionDenied,
    RateLimited,
    RequestTimeout,
    RequestTooLarge,
    ServiceUnavailable,
    UnsupportedMediaType,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Kind:
    status: int
    type: str  # OpenAI's error `type`


# Looked up along the error's class hierarchy: the most specific entry wins.
KINDS: dict[type[GatewayError], Kind] = {
    GatewayError: Kind(500, "internal_server_error"),
    InvalidRequest: Kind(400, "invalid_request_error"),
    UnsupportedMediaType: Kind(415, "invalid_request_error"),
    MethodNotAllowed: Kind(405, "invalid_request_error"),
    AuthenticationError: Kind(401, "authentication_error"),
    PermissionDenied: Kind(403, "permission_error"),
    NotFound: Kind(404, "not_found_error"),
    RequestTooLarge: Kind(413, "invalid_request_error"),
    RateLimited: Kind(429, "rate_limit_error"),
    RequestTimeout: Kind(504, "timeout_error"),
    EngineError: Kind(500, "internal_server_error"),
    ServiceUnavailable: Kind(503, "service_unavailable"),
}


class HTTPStatusError(GatewayError):
    """A status Starlette chose (routing, a framework check) that has no kind
    of its own."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def kind_of(err: GatewayError) -> Kind:
    if isinstance(err, HTTPStatusError):
        return Kind(err.status, "invalid_request_error" if err.status < 500 else "internal_server_error")
    for cls in type(err).__mro__:
        kind = KINDS.get(cls)
        if kind is not None:
            return kind
    raise AssertionError("unreachable: GatewayError is in the table")


def status_of(err: GatewayError) -> int:
    return kind_of(err).status


def error_body(err: GatewayError) -> dict[str, Any]:
    kind = kind_of(err)
    return {
        "error": {
            "message": err.message,
            "type": kind.type,
            "param": err.param,
            "code": err.code if err.code is not None else kind.status,
        }
    }


def error_headers(err: GatewayError) -> dict[str, str]:
    headers = dict(err.headers)
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    return headers


def error_response(err: GatewayError) -> Response:
    return Response(
        orjson.dumps(error_body(err)),
        status_code=status_of(err),
        media_type="application/json",
        headers=error_headers(err),
    )


def error_event(err: GatewayError) -> bytes:
    """An error after a stream began: an SSE error event (then `[DONE]`)."""
    return b"data: " + orjson.dumps(error_body(err)) + b"\n\n"


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # drop pydantic's union-branch names such as "str" or "list[int]"
    clean: list[str] = []
    for p in parts:
        if p.isdigit() and clean:
            clean[-1] += f"[{p}]"
        elif "[" in p or p in ("str", "int", "float", "bool", "function-after", "constrained-str"):
            continue
        else:
            clean.append(p)
    return ".".join(clean) or None


def validation_error(exc: RequestValidationError) -> InvalidRequest:
    errors = exc.errors()
    if not errors:
        return InvalidRequest("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return InvalidRequest("request body is not valid JSON", code="invalid_json")
    param = _loc_to_param(tuple(first.get("loc", ())))
    msg = str(first.get("msg", "invalid value"))
    if first.get("type") == "missing":
        msg = f"missing required parameter: {param}"
    elif param:
        msg = f"invalid value for {param}: {msg}"
    return InvalidRequest(msg, param=param, code="invalid_value")


def install_error_handlers(app: FastAPI) -> None:
    async def on_gateway(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return error_response(exc)

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return error_response(validation_error(exc))

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        err: GatewayError
        if exc.status_code == 404:
            err = NotFound(f"no route {request.url.path}")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}")
        else:
            err = HTTPStatusError(str(exc.detail), exc.status_code)
        return error_response(err)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(GatewayError("internal error; see the gateway log", code="internal_error"))

    app.add_exception_handler(GatewayError, on_gateway)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
