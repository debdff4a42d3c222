"""Pure ASGI middleware (no per-request task, streams untouched): request id,
body limit, content type, HTTP metrics, the request's record (to the access
log and the other record sinks) and the request's trace span.

Record sinks: `sinks` is a list of callables, each given the record dict of
every finished request (server/access_log.py `build_record`: succeeded,
failed or cancelled, streams when their last byte is out). The app keeps
the list as `app.state.record_sinks`; a consumer (the usage ledger, the
console's recent requests) appends to it. A sink runs on the event loop
after the response: it must be quick and must not await; one that raises
is logged, and the others still run.

One middleware, so one send and one receive wrapper per request: every SSE
chunk goes through each wrapper in the stack. It never reads or buffers a
body: routing data (the session key, the target that answered) travels in
the request and the lease.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_adapter.errors import GatewayError, InvalidRequest, RequestTooLarge, UnsupportedMediaType
from server.access_log import AccessLog, Network, build_record, trace_id_of
from server.errors import ClientDisconnected, error_headers, shape_for
from server.metrics import GatewayMetrics

if TYPE_CHECKING:
    from server.fast_relay import FastRelay
    from server.tracing import Tracing

logger = logging.getLogger(__name__)
_JSON_ROUTES = ("/v1/", "/tokenize", "/detokenize", "/admin/", "/generate")
RecordSink = Callable[[dict[str, Any]], None]


class GatewayMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        metrics: GatewayMetrics,
        max_body: int,
        access_log: AccessLog | None = None,
        tracing: Tracing | None = None,
        sinks: list[RecordSink] | None = None,
        proxies: tuple[Network, ...] = (),
        fast: FastRelay | None = None,
    ) -> None:
        self.app = app
        self.fast = fast
        self.metrics = metrics
        self.max_body = max_body
        self.access_log = access_log
        self.tracing = tracing
        self.sinks: list[RecordSink] = sinks if sinks is not None else []  # the app's list: appended to later
        self.proxies = access_log.proxies if access_log is not None else proxies

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        headers = dict(scope["headers"])
        rid = headers.get(b"x-request-id", b"").decode("latin-1")[:200] or os.urandom(16).hex()
        state = scope.setdefault("state", {})
        state["request_id"] = rid
        status = 500
        rid_header = (b"x-request-id", rid.encode("latin-1"))
        start_wall = time.time()
        span = None
        if self.tracing is not None:
            span = self.tracing.begin(scope, headers, state)
        elif b"traceparent" in headers:
            # not tracing here: the client's trace still reaches the nodes
            state["trace_headers"] = tuple(
                (k.decode("latin-1"), headers[k].decode("latin-1")) for k in (b"traceparent", b"tracestate")
                if k in headers
            )

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                state["t_response"] = time.perf_counter()
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
            receive_app: Receive | None = receive_wrapper
            if self.fast is not None:  # the gateway tier's pass-through requests (server/fast_relay.py)
                receive_app = await self.fast(scope, receive_wrapper, send_wrapper)
            if receive_app is not None:
                await self.app(scope, receive_app, send_wrapper)
        except asyncio.CancelledError as e:
            if "t_response" not in state:
                status = 499  # the client left before the status line (as nginx logs it)
            task = asyncio.current_task()
            if not isinstance(e, ClientDisconnected) or (task is not None and task.cancelling()):
                raise  # a real cancellation (shutdown) goes on
            # else the handler's word that its client left: nothing to answer, nothing to log
        finally:
            end = time.perf_counter()
            if status == 500 and "t_response" not in state and state.get("outcome") == "cancelled":
                status = 499  # a stream whose client left before its first token ends quietly
            route = scope.get("route")
            path = getattr(route, "path", None) or "other"
            self.metrics.http_done(path, scope["method"], 500 if status == 499 else status, end - start)
            if self.access_log is not None or span is not None or self.sinks:
                self._observe(scope, headers, state, status, start_wall, start, end, span)

    def _observe(
        self,
        scope: Scope,
        headers: dict[bytes, bytes],
        state: dict[str, object],
        status: int,
        start_wall: float,
        start: float,
        end: float,
        span: object,
    ) -> None:
        """The record to the access log and the sinks, and the trace; none may
        fail the request."""
        rec = None
        trace_id = None
        try:
            if span is not None:
                trace_id = format(span.get_span_context().trace_id, "032x")  # type: ignore[attr-defined]
            else:
                trace_id = trace_id_of(headers)
            if self.access_log is not None or self.sinks:
                rec = build_record(scope, headers, state, status, start_wall, start, end, trace_id, self.proxies)
            if self.access_log is not None and rec is not None:
                self.access_log.write(rec)
            if span is not None and self.tracing is not None:
                self.tracing.end(span, scope, state, rec, status, int(start_wall * 1e9), start, end)  # type: ignore[arg-type]
        except Exception:
            logger.exception("access log / trace of request %s failed", state.get("request_id"))
        if rec is not None:
            for sink in self.sinks:
                try:
                    sink(rec)
                except Exception:
                    logger.exception("record sink %r failed on request %s", sink, state.get("request_id"))

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
