"""Pure ASGI middleware (no per-request task, streams untouched): request id,
body limit, content type, HTTP metrics, the request's record (to the access
log and the other record sinks) and the request's trace span; and the access
log it writes.

Record sinks: `sinks` is a list of callables, each given the record dict of
every finished request (`build_record`: succeeded, failed or cancelled,
streams when their last byte is out). The app keeps the list as
`app.state.record_sinks`; a consumer (the usage ledger, the console's
recent requests) appends to it. A sink runs on the event loop after the
response: it must be quick and must not await; one that raises is logged,
and the others still run.

One middleware, so one send and one receive wrapper per request: every SSE
chunk goes through each wrapper in the stack. It never reads or buffers a
body: routing data (the session key, the target that answered) travels in
the request and the lease.

The access log (`AccessLog`): one structured line per HTTP request, written
when the response is over (streams included). Fields: time (the request's
start, UTC), request id, trace id, key name (never the key), method,
endpoint, model (as asked), target (what answered: an alias's choice, or
the node's name), upstream (the node's URL, for a passed-through request),
status, finish reason (`cancelled` when the client left, `error` when it
failed after its status line), tokens (prompt, completion, cached), queue
wait, TTFT, duration, and the client address. Prompts and outputs are never
logged: nothing here sees a body.

What the route learns (key name, model, target, tokens, queue wait, first
token) the generation core notes on `scope["state"]` (see `note_*` in
server/generation.py); `build_record` makes the record from it.

The client address is the peer's, unless the peer is one of
`--trusted-proxies` (parsed by server/settings_parse.py `parse_proxies`):
then `X-Forwarded-For` is read from the right, skipping trusted proxies,
and the first address that is not one is the client's (a client cannot
forge the entries a trusted proxy appended).

`--access-log-format off` costs nothing per request: no logger is built.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import logging.handlers
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine_adapter.errors import GatewayError, InvalidRequest, RequestTooLarge, UnsupportedMediaType
from server.errors import ClientDisconnected, error_headers, shape_for
from server.metrics import GatewayMetrics
from server.settings_parse import Network

if TYPE_CHECKING:
    from server.fast_relay import FastRelay
    from server.state import Gateway
    from server.tracing import Tracing

logger = logging.getLogger(__name__)


def _relaying(scope: Scope) -> Gateway | None:
    """The gateway while some model of it is passed through to upstream
    nodes (only then is the short path tried), else None."""
    app = scope.get("app")
    gw: Gateway | None = getattr(app.state, "gateway", None) if app is not None else None
    return gw if gw is not None and gw.relays else None


ACCESS_LOGGER = "npu_gateway.access"
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
            fast = self.fast
            gw = _relaying(scope) if fast is not None else None
            if fast is not None and gw is not None:  # the gateway tier's pass-through requests (server/fast_relay.py)
                receive_app = await fast(gw, scope, receive_wrapper, send_wrapper)
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


# ---- the access log and the request's record ------------------------------


def _trusted(host: str, proxies: tuple[Network, ...]) -> bool:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(addr in n for n in proxies)


def client_address(scope: Mapping[str, Any], headers: dict[bytes, bytes], proxies: tuple[Network, ...]) -> str:
    """The client's address: the peer, or, from a trusted proxy, the
    rightmost untrusted `X-Forwarded-For` entry."""
    client = scope.get("client")
    peer = str(client[0]) if client else ""
    if not proxies or not _trusted(peer, proxies):
        return peer
    xff = headers.get(b"x-forwarded-for")
    if not xff:
        return peer
    hops = [h.strip() for h in xff.decode("latin-1").split(",") if h.strip()]
    for hop in reversed(hops):
        if not _trusted(hop, proxies):
            return hop[:64]
    return hops[0][:64] if hops else peer


def trace_id_of(headers: dict[bytes, bytes]) -> str | None:
    """The trace id of a W3C `traceparent` (version-traceid-spanid-flags)."""
    tp = headers.get(b"traceparent")
    if tp is None or len(tp) < 55:
        return None
    tid = tp[3:35].decode("latin-1")
    return tid if tid != "0" * 32 else None


class AccessLog:
    """Formats and writes the lines (`fmt`: json or text)."""

    def __init__(self, fmt: str, path: Path | None, proxies: tuple[Network, ...]) -> None:
        self.fmt = fmt
        self.path = path
        self.proxies = proxies
        self.logger = logging.getLogger(ACCESS_LOGGER)
        self._handler: logging.Handler | None = None

    def start(self) -> None:
        """Open the output (in the serving process: after any fork)."""
        handler: logging.Handler
        if self.path is not None:
            # WatchedFileHandler reopens the file after logrotate moves it
            handler = logging.handlers.WatchedFileHandler(self.path, encoding="utf-8")
        else:
            handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        self.logger.addHandler(handler)
        self.logger.setLevel(logging.INFO)
        self.logger.propagate = False  # one line, not a second copy through the root logger
        self._handler = handler

    def stop(self) -> None:
        if self._handler is not None:
            self.logger.removeHandler(self._handler)
            self._handler.close()
            self._handler = None

    def line(self, rec: dict[str, Any]) -> str:
        if self.fmt == "json":
            return orjson.dumps(rec).decode()
        return " ".join(f"{k}={_text(v)}" for k, v in rec.items())

    def write(self, rec: dict[str, Any]) -> None:
        logger, handler = self.logger, self._handler
        if (type(handler) is logging.StreamHandler and logger.handlers == [handler] and not handler.filters
                and not logger.filters and not logger.disabled):
            # our stderr handler alone: the line as it would format it, without
            # building a LogRecord (a measurable share of a short request's CPU)
            line = self.line(rec) + handler.terminator
            with handler.lock:  # type: ignore[union-attr]
                handler.stream.write(line)
                handler.flush()
        elif logger.isEnabledFor(logging.INFO):  # another handler is attached (a test's): a record
            logger.handle(logging.LogRecord(logger.name, logging.INFO, __file__, 0, self.line(rec), None, None))


def build_record(
    scope: Mapping[str, Any],
    headers: dict[bytes, bytes],
    state: dict[str, Any],
    status: int,
    start_wall: float,
    start: float,
    end: float,
    trace_id: str | None,
    proxies: tuple[Network, ...],
) -> dict[str, Any]:
    """The one record of a finished request, whether it succeeded, failed or
    was cancelled: the access log's line, the usage ledger's row, any other
    sink's input (see `GatewayMiddleware.sinks`)."""
    admit_at = state.get("t_admit")
    admitted_at = state.get("t_admitted")
    first_at = state.get("t_first")
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(start_wall)) + f".{int(start_wall % 1 * 1000):03d}Z",
        "request_id": state.get("request_id"),
        "trace_id": trace_id,
        "key": state.get("key"),
        "method": scope.get("method"),
        "endpoint": scope.get("path"),
        "model": state.get("model"),
        "target": state.get("target"),
        "upstream": state.get("upstream"),
        "status": status,
        "finish_reason": finish_reason(state, status),
        "prompt_tokens": state.get("prompt_tokens"),
        "completion_tokens": state.get("completion_tokens"),
        "cached_tokens": state.get("cached_tokens"),
        "queue_wait": _r(admitted_at - admit_at) if admit_at is not None and admitted_at is not None else None,
        "ttft": _r(first_at - start) if first_at is not None else None,
        "duration": _r(end - start),
        "client": client_address(scope, headers, proxies),
    }


def finish_reason(state: dict[str, Any], status: int) -> str | None:
    """How the request ended: `cancelled` (the client left), `error` (failed
    after its status line), else the engines' finish reasons (`stop`,
    `length`, ...; several joined by commas for n > 1)."""
    outcome = state.get("outcome")
    if outcome is not None:
        return str(outcome)
    if status == 499:
        return "cancelled"
    reasons = state.get("finish_reasons")
    if not reasons:
        return None
    if len(reasons) == 1:
        return str(next(iter(reasons)))
    return ",".join(sorted(reasons))


def _r(seconds: float) -> float:
    return round(seconds, 6)


_UNSAFE = re.compile(r'[\s"\\=]')


def _text(v: Any) -> str:
    if v is None:
        return "-"
    if type(v) is not str:
        return str(v)
    if not v or _UNSAFE.search(v):
        return orjson.dumps(v).decode()  # quoted and escaped: one line, fields stay separable
    return v
