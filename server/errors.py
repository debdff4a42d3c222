"""The tables from error kind to HTTP status, error `type` and `Retry-After`,
one per API family, used for JSON error bodies and for SSE error events alike:

- OpenAI (`KINDS`): every route but the two below;
- Anthropic (`ANTHROPIC_KINDS`): paths under `/v1/messages`;
- TGI (`TGI_KINDS`): `/generate`, `/generate_stream` (both of their shapes) and TGI's `POST /`.

`shape_for(path)` picks the family; the exception handlers and the
middleware's pre-checks answer in it."""

from __future__ import annotations

import asyncio
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
    QueueFull,
    QueueTimeout,
    RateLimited,
    RequestTimeout,
    RequestTooLarge,
    ServiceUnavailable,
    UnsupportedMediaType,
    UpstreamRejected,
)
from server.apis.generate.protocol import SHAPE_ERROR

logger = logging.getLogger(__name__)


class ClientDisconnected(asyncio.CancelledError):
    """Raised by a handler whose client left (`until_disconnect`): there is
    nobody to answer. The middleware logs the request (499) and ends it
    quietly; uvicorn would log any exception that reached it as a crash."""


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
    if isinstance(err, HTTPStatusError | UpstreamRejected):
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
    if isinstance(err, UpstreamRejected):  # the node's own status and body
        return Response(err.body, status_code=err.status, media_type=err.content_type, headers=error_headers(err))
    return Response(
        orjson.dumps(error_body(err)),
        status_code=status_of(err),
        media_type="application/json",
        headers=error_headers(err),
    )


def error_event(err: GatewayError) -> bytes:
    """An error after a stream began: an SSE error event (then `[DONE]`)."""
    return b"data: " + orjson.dumps(error_body(err)) + b"\n\n"


# The tags of the tagged unions (the /generate shapes, Responses input items,
# Anthropic content blocks): pydantic puts them in an error's location.
_BODY_TAGS = frozenset(("vllm", "tgi"))
_ITEM_TAGS = frozenset(("message", "function_call", "function_call_output", "text", "tool_use", "tool_result"))


def _loc_to_param(loc: tuple[Any, ...]) -> str | None:
    raw = [str(p) for p in loc]
    # a union tag right after the body or a list index names no parameter
    parts = [
        p for i, p in enumerate(raw)
        if p != "body" and not (
            i > 0 and ((p in _BODY_TAGS and raw[i - 1] == "body") or (p in _ITEM_TAGS and raw[i - 1].isdigit()))
        )
    ]
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
        msg = f"missing required parameter: {param}" if param else "the request has no JSON body"
    elif param:
        msg = f"invalid value for {param}: {msg}"
    return InvalidRequest(msg, param=param, code="invalid_value")


# ---- Anthropic ------------------------------------------------------------
# Anthropic's statuses: a full queue or a queue wait is "overloaded" (529, which
# its SDK retries); a draining or dead engine is 503, so nginx fails over.
ANTHROPIC_KINDS: dict[type[GatewayError], Kind] = {
    **KINDS,  # OpenAI's where the two agree, and Anthropic's own:
    GatewayError: Kind(500, "api_error"),
    RequestTooLarge: Kind(413, "request_too_large"),
    QueueFull: Kind(529, "overloaded_error"),
    EngineError: Kind(500, "api_error"),
    ServiceUnavailable: Kind(503, "overloaded_error"),
    QueueTimeout: Kind(529, "overloaded_error"),
}

# ---- TGI (and vLLM's api_server /generate) ----------------------------------
# TGI's `error_type`s: validation (422), overloaded (429/503), generation.
TGI_KINDS: dict[type[GatewayError], Kind] = {
    GatewayError: Kind(500, "generation"),
    InvalidRequest: Kind(422, "validation"),
    UnsupportedMediaType: Kind(415, "validation"),
    MethodNotAllowed: Kind(405, "validation"),
    AuthenticationError: Kind(401, "authentication"),
    PermissionDenied: Kind(403, "permission"),
    NotFound: Kind(404, "not_found"),
    RequestTooLarge: Kind(413, "validation"),
    RateLimited: Kind(429, "overloaded"),
    RequestTimeout: Kind(504, "incomplete_generation"),
    EngineError: Kind(500, "generation"),
    ServiceUnavailable: Kind(503, "overloaded"),
}


class Shape:
    """One API family's error rendering (OpenAI's is the functions above;
    the others override `body`)."""

    def __init__(self, table: dict[type[GatewayError], Kind]) -> None:
        self.table = table

    def kind(self, err: GatewayError) -> Kind:
        if self.table is KINDS:
            return kind_of(err)
        status = getattr(err, "status", None)  # an error that carries its own status
        if isinstance(status, int):
            return Kind(status, self.table[InvalidRequest if status < 500 else GatewayError].type)
        for cls in type(err).__mro__:
            kind = self.table.get(cls)
            if kind is not None:
                return kind
        raise AssertionError("unreachable: GatewayError is in the table")

    def body(self, err: GatewayError) -> dict[str, Any]:
        return error_body(err)

    def native(self, body: bytes) -> bool:
        """Whether a node's error body is already in this shape."""
        return False

    def response(self, err: GatewayError) -> Response:
        if self.table is KINDS:  # OpenAI's: the module's own response (an upstream's refusal relayed as is)
            return error_response(err)
        if isinstance(err, UpstreamRejected) and self.native(err.body):  # a node that serves this API refused
            return error_response(err)
        return Response(
            orjson.dumps(self.body(err)), status_code=self.kind(err).status, media_type="application/json",
            headers=error_headers(err),
        )


class _AnthropicShape(Shape):
    def body(self, err: GatewayError) -> dict[str, Any]:
        return {"type": "error", "error": {"type": self.kind(err).type, "message": err.message}}

    def native(self, body: bytes) -> bool:
        return _json_has(body, "type", "error")


class _TgiShape(Shape):
    def body(self, err: GatewayError) -> dict[str, Any]:
        return {"error": err.message, "error_type": self.kind(err).type}

    def native(self, body: bytes) -> bool:
        return _json_has(body, "error_type")


def _json_has(body: bytes, key: str, value: Any = None) -> bool:
    try:
        obj = orjson.loads(body)
    except ValueError:
        return False
    return isinstance(obj, dict) and key in obj and (value is None or obj[key] == value)


OPENAI = Shape(KINDS)
ANTHROPIC = _AnthropicShape(ANTHROPIC_KINDS)
TGI = _TgiShape(TGI_KINDS)


def shape_for(path: str) -> Shape:
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return ANTHROPIC
    if path in ("/generate", "/generate_stream", "/"):  # "/": TGI's compat route
        return TGI
    return OPENAI


def anthropic_error_event(err: GatewayError) -> bytes:
    """An error after an Anthropic stream began: `event: error`."""
    return b"event: error\ndata: " + orjson.dumps(ANTHROPIC.body(err)) + b"\n\n"


def tgi_error_event(err: GatewayError) -> bytes:
    """An error after a TGI stream began: a `data:` event with `error`."""
    return b"data:" + orjson.dumps(TGI.body(err)) + b"\n\n"


# A /generate body that is neither shape is a 400 (the other /generate
# validation errors are TGI's 422).
GENERATE_SHAPE_ERROR = SHAPE_ERROR


def install_error_handlers(app: FastAPI) -> None:
    async def on_gateway(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, GatewayError)
        return shape_for(request.url.path).response(exc)

    async def on_validation(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        err: GatewayError = validation_error(exc)
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == GENERATE_SHAPE_ERROR:
            err = HTTPStatusError(str(first.get("msg")), 400)
        return shape_for(request.url.path).response(err)

    async def on_http(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        err: GatewayError
        if exc.status_code == 404:
            err = NotFound(f"no route {request.url.path}")
        elif exc.status_code == 405:
            err = MethodNotAllowed(f"method {request.method} not allowed on {request.url.path}")
        else:
            err = HTTPStatusError(str(exc.detail), exc.status_code)
        return shape_for(request.url.path).response(err)

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        err = GatewayError("internal error; see the gateway log", code="internal_error")
        return shape_for(request.url.path).response(err)

    app.add_exception_handler(GatewayError, on_gateway)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
