"""One mapping from errors to OpenAI error JSON (or an SSE error event)."""

from __future__ import annotations

import logging
import math
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from engine_adapter.errors import GatewayError, InvalidRequest

logger = logging.getLogger(__name__)


def error_headers(err: GatewayError) -> dict[str, str]:
    headers = dict(err.headers)
    if err.retry_after is not None:
        headers["Retry-After"] = str(max(1, math.ceil(err.retry_after)))
    return headers


def error_response(err: GatewayError) -> Response:
    return Response(
        orjson.dumps(err.to_dict()),
        status_code=err.status,
        media_type="application/json",
        headers=error_headers(err),
    )


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
        from engine_adapter.errors import NotFound

        err: GatewayError
        if exc.status_code == 404:
            err = NotFound(f"no route {request.url.path}")
        elif exc.status_code == 405:
            err = InvalidRequest(f"method {request.method} not allowed on {request.url.path}")
            err.status = 405
        else:
            err = GatewayError(str(exc.detail))
            err.status = exc.status_code
        return error_response(err)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(GatewayError("internal error; see the gateway log", code="internal_error"))

    app.add_exception_handler(GatewayError, on_gateway)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
