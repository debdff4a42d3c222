"""Who asks, for every generating route: the served model a key may use,
the request's priority, deadline, key name and forwarded headers (a
`Caller`), and the unknown fields a lenient body ignores."""

from __future__ import annotations

import logging
from typing import Protocol

from starlette.requests import Request

from server.ask import Caller
from server.auth import Principal
from server.protocol import LenientRequest
from server.state import Gateway, ServedModel
from server.validation import deadline_after

logger = logging.getLogger(__name__)


def allowed_model(gw: Gateway, principal: Principal, name: str | None, kind: str = "generate") -> ServedModel:
    """The served model `name` resolves to, once the key may use it."""
    model = gw.resolve(name, kind)
    principal.check_model(model.id)
    return model


def ignore_unknown(body: LenientRequest) -> None:
    """Say (at debug level) which fields of a body are accepted and ignored."""
    if body.model_extra:
        logger.debug("ignoring unknown fields: %s", ", ".join(body.unknown_fields()))


class _Prioritized(Protocol):
    @property
    def priority(self) -> int: ...

    @property
    def model_fields_set(self) -> set[str]: ...


def caller_of(request: Request, gw: Gateway, principal: Principal, body: _Prioritized | None = None) -> Caller:
    """Who asks: `body`'s priority if it sent one, else its key's default;
    the deadline of the whole request, from now; the key's name; the headers
    the request forwards."""
    if body is None:
        priority = principal.priority_for(0, False)
    else:
        priority = principal.priority_for(body.priority, "priority" in body.model_fields_set)
    return Caller(priority, deadline_after(gw.settings.request_timeout), principal.name, forwarded(request))


def forwarded(request: Request) -> tuple[tuple[str, str], ...]:
    """Headers an upstream node gets too: the gateway's request id, and the
    trace context (`traceparent`, set by the middleware)."""
    state = request.scope.get("state", {})
    rid = state.get("request_id")
    trace: tuple[tuple[str, str], ...] = state.get("trace_headers", ())
    return ((("X-Request-Id", rid),) if rid else ()) + trace
