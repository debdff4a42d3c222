"""The access log: one structured line per HTTP request, written when the
response is over (streams included).

Fields: time (the request's start, UTC), request id, trace id, key name
(never the key), method, endpoint, model (as asked), target (what answered:
an alias's choice, or the node's name), upstream (the node's URL, for a
passed-through request), status, finish reason (`cancelled` when the client
left, `error` when it failed after its status line), tokens (prompt,
completion, cached), queue wait, TTFT, duration, and the client address. Prompts and
outputs are never logged: nothing here sees a body.

What the route learns (key name, model, target, tokens, queue wait, first
token) the generation core notes on `scope["state"]` (see `note_*` in
server/generation.py); the middleware writes the line from it.

The client address is the peer's, unless the peer is one of
`--trusted-proxies`: then `X-Forwarded-For` is read from the right, skipping
trusted proxies, and the first address that is not one is the client's
(a client cannot forge the entries a trusted proxy appended).

`--access-log-format off` costs nothing per request: no logger is built.
"""

from __future__ import annotations

import ipaddress
import logging
import logging.handlers
import re
import sys
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import orjson

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

ACCESS_LOGGER = "npu_gateway.access"


def parse_proxies(items: Iterable[str]) -> tuple[Network, ...]:
    """`10.0.0.1`, `10.0.0.0/8`, `::1` -> networks; raises ValueError."""
    return tuple(ipaddress.ip_network(s.strip(), strict=False) for s in items if s.strip())


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
