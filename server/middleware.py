"""Pure ASGI middleware (no per-request task, streams untouched): request id,
body limit, content type, HTTP metrics, and the routing context.

One middleware, so one send and one receive wrapper per request: every SSE
chunk goes through each wrapper in the stack.

Routing context: each generation/embedding request gets a RouteContext with
the session key in (the `X-Session-ID` header, else the body's `user`,
parsed only if a router asks) and the served-by name out, as the
`x-npugw-served-by` header. For a routed SSE response the headers wait for
the first body chunk, when the answering target is known.
"""

from __future__ import annotations

import os
import time

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_adapter.errors import GatewayError, InvalidRequest, RequestTooLarge
from engine_adapter.routing import ROUTE_CONTEXT, RouteContext
from server.errors import error_headers
from server.metrics import GatewayMetrics

_JSON_ROUTES = ("/v1/", "/tokenize", "/detokenize", "/admin/")
_ROUTED_PATHS = frozenset(("/v1/chat/completions", "/v1/completions", "/v1/embeddings"))
SERVED_BY = b"x-npugw-served-by"


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
        ctx: RouteContext | None = None
        held: Message | None = None
        body: list[bytes] = []  # kept only until the router asked for the session or the response began
        if scope["path"] in _ROUTED_PATHS:
            ctx = RouteContext()
            session = headers.get(b"x-session-id")
            if session:
                ctx.session = session.decode("latin-1")[:256]
            else:
                ctx.session_loader = lambda: _user_from(body)

        async def send_wrapper(message: Message) -> None:
            nonlocal status, held
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [*message.get("headers", []), rid_header]
                if ctx is not None:
                    if ctx.routed:  # the answering target is known at the first body chunk
                        held = message
                        return
                    body.clear()  # not routed: no router will ask for the session
            elif held is not None:
                first, held = held, None
                await send(_with_served_by(first, ctx))
            await send(message)

        seen = 0
        limit = self.max_body

        async def receive_wrapper() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                chunk = message.get("body", b"")
                seen += len(chunk)
                if seen > limit:
                    raise RequestTooLarge(f"request body is over this server's limit of {limit} bytes")
                if ctx is not None and ctx.session_loader is not None:
                    body.append(chunk)
            return message

        token = ROUTE_CONTEXT.set(ctx) if ctx is not None else None
        try:
            err = self._precheck(scope, headers)
            if err is not None:
                await _send_error(send_wrapper, err)
                return
            await self.app(scope, receive_wrapper, send_wrapper)
            if held is not None:
                await send(_with_served_by(held, ctx))
        finally:
            if token is not None:
                ROUTE_CONTEXT.reset(token)
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
                err = InvalidRequest(
                    f"Content-Type must be application/json, not {ctype.decode('latin-1') or 'missing'}",
                    code="unsupported_media_type",
                )
                err.status = 415
                return err
        return None


async def _send_error(send: Send, err: GatewayError) -> None:
    body = orjson.dumps(err.to_dict())
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in error_headers(err).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _user_from(chunks: list[bytes]) -> str | None:
    if not chunks:
        return None
    body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    chunks.clear()
    if b'"user"' not in body:
        return None
    try:
        user = orjson.loads(body).get("user")
    except (ValueError, AttributeError):
        return None
    return user if isinstance(user, str) and user else None


def _with_served_by(message: Message, ctx: RouteContext | None) -> Message:
    if ctx is None or ctx.served_by is None:
        return message
    return {**message, "headers": [*message.get("headers", []), (SERVED_BY, ctx.served_by.encode("latin-1"))]}
