"""Pure ASGI middleware (no per-request task, streams untouched): request id,
body limit, content type and HTTP metrics.

One middleware, so one send and one receive wrapper per request: every SSE
chunk goes through each wrapper in the stack. It never reads or buffers a
body: routing data (the session key, the target that answered) travels in
the request and the lease.
"""

from __future__ import annotations

import os
import time

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_adapter.errors import GatewayError, InvalidRequest, RequestTooLarge, UnsupportedMediaType
from server.errors import error_headers, shape_for
from server.metrics import GatewayMetrics

_JSON_ROUTES = ("/v1/", "/tokenize", "/detokenize", "/admin/", "/generate")


class GatewayMiddleware:
    def __init__(self, app: ASGIApp, metrics: GatewayMetrics, max_body: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body = max_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:200] or os.urandom(16).hex()
        scope.setdefault("state", {})["request_id"] = rid
        status = 500
        rid_header = (b"x-request-id", rid.encode("latin-1"))

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), rid_header]
            await send(message)

        seen = 0
        limit = self.max_body

        async def receive_wrapper() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise RequestTooLarge(f"request body is over this server's limit of {limit} bytes")
            return message

        try:
            err = self._precheck(scope, headers)
            if err is not None:
                await _send_error(send_wrapper, err, scope["path"])
                return
            await self.app(scope, receive_wrapper, send_wrapper)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "other"
            self.metrics.http_done(path, scope["method"], status, time.perf_counter() - start)

    def _precheck(self, scope: Scope, headers: dict[bytes, bytes]) -> GatewayError | None:
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return None
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return InvalidRequest("bad Content-Length header")
            if n > self.max_body:
                return RequestTooLarge(
                    f"request body of {n} bytes is over this server's limit of {self.max_body} bytes"
                )
        path: str = scope["path"]
        if path.startswith(_JSON_ROUTES):
            ctype = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if ctype != b"application/json" and length != b"0":
                return UnsupportedMediaType(
                    f"Content-Type must be application/json, not {ctype.decode('latin-1') or 'missing'}"
                )
        return None


async def _send_error(send: Send, err: GatewayError, path: str) -> None:
    shape = shape_for(path)  # the error shape of the API the path belongs to
    body = orjson.dumps(shape.body(err))
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error_headers(err).items()]
    await send({"type": "http.response.start", "status": shape.kind(err).status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
