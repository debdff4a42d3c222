"""What a generating route asks of the target admission picks (the Ask of
engine_adapter/lease.py): the same client request, as engine requests for a
local engine (validated and tokenized with that engine's tokenizer, once
per tokenizer) or as one pass-through call for upstream nodes (the client's
JSON body, untouched).

And who asks, for every generating route: the served model a key may use,
the request's priority, deadline, key name and forwarded headers (a
`Caller`), the unknown fields a lenient body ignores, and the time to first
token the request is due by (`x-ttft-deadline-ms`, or its key's default)."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Protocol

import orjson
from starlette.requests import Request

from engine_adapter.errors import InvalidRequest
from engine_adapter.lease import Ask
from engine_adapter.types import GenerationRequest, RelayCall
from server.auth import Principal
from server.protocol import LenientRequest
from server.state import Gateway, ServedModel
from server.validation import deadline_after

logger = logging.getLogger(__name__)

TTFT_HEADER = "x-ttft-deadline-ms"


def engine_trace(headers: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The W3C trace context among the headers a request forwards."""
    return tuple((k, v) for k, v in headers if k in ("traceparent", "tracestate"))


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks, and until when, alike for every API (`caller_of`): the
    request's priority, the deadline of the whole request, the key's name,
    and the headers it forwards (a trace context)."""

    priority: int
    deadline: float | None
    api_key_name: str | None
    forward: tuple[tuple[str, str], ...] = ()


class RouteAsk:
    """Subclasses build the local requests in `build(pool)`."""

    path: str = ""

    def __init__(
        self,
        raw: bytes,
        *,
        caller: Caller,
        request_id: str,
        stream: bool,
        want_usage: bool,
        max_tokens: int | None,
        n: int = 1,
        body: dict[str, Any] | None = None,
    ) -> None:
        self.raw = raw
        self.caller = caller
        self.request_id = request_id
        self.stream = stream
        self.want_usage = want_usage
        self.max_tokens = max_tokens
        self.n = n
        self._built: dict[int, list[GenerationRequest]] = {}
        self._body = body  # `raw` parsed (by the caller, or on first use)

    def build(self, pool: Any) -> list[GenerationRequest]:
        raise NotImplementedError

    def local(self, pool: Any, model: str) -> list[GenerationRequest]:
        key = id(pool.tokenizer)
        reqs = self._built.get(key)
        if reqs is None:
            reqs = self.build(pool)
            trace = engine_trace(self.caller.forward)
            if trace:  # for an engine that traces itself (vLLM's own spans join the request's trace)
                reqs = [replace(r, trace_headers=trace) for r in reqs]
            self._built[key] = reqs
        return [r if r.model == model else replace(r, model=model) for r in reqs]

    def relay(self, model: str) -> RelayCall:
        if self._body is None:
            self._body = orjson.loads(self.raw)
        return self.relay_call(model, self.path, self._body, self.stream, self.want_usage)

    def relay_call(self, model: str, path: str, body: dict[str, Any], stream: bool, want_usage: bool) -> RelayCall:
        """A call to upstream nodes on behalf of this request's caller."""
        c = self.caller
        return RelayCall(
            request_id=self.request_id, model=model, path=path, body=body, stream=stream, want_usage=want_usage,
            priority=c.priority, deadline=c.deadline, api_key_name=c.api_key_name, headers=c.forward,
        )

    def budget(self) -> int:
        """Tokens reserved against the key's per-minute limit at admission
        (settled to the real count at the end): prompt + max_tokens x n when
        the request was tokenized here, else an estimate (a token per four
        bytes of the body, plus max_tokens x n)."""
        for reqs in self._built.values():
            return sum(len(r.prompt_token_ids) + r.sampling.max_tokens * r.sampling.n for r in reqs)
        return len(self.raw) // 4 + (self.max_tokens or 0) * self.n


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


def ttft_deadline(request: Request, principal: Principal) -> float | None:
    """When the request's first token is due (a `time.monotonic()` value):
    its `x-ttft-deadline-ms` header, else its key's `ttft_deadline_ms`, else
    None. A header that is not a positive number of milliseconds is a 400."""
    raw = request.headers.get(TTFT_HEADER)
    if raw is None:
        ms = principal.entry.ttft_deadline_ms if principal.entry is not None else None
    else:
        try:
            ms = float(raw.strip())
        except ValueError:
            ms = math.nan
        if not math.isfinite(ms) or ms <= 0:
            raise InvalidRequest(
                f"header `{TTFT_HEADER}` must be a positive number of milliseconds, not {raw[:40]!r}",
                param=TTFT_HEADER, code="invalid_value",
            )
    return None if ms is None else time.monotonic() + ms / 1000.0


class DeadlineAsk:
    """An Ask whose requests carry a time-to-first-token deadline."""

    def __init__(self, inner: Ask, deadline: float) -> None:
        self.inner = inner
        self.deadline = deadline

    def local(self, pool: Any, model: str) -> list[GenerationRequest]:
        return [replace(r, ttft_deadline=self.deadline) for r in self.inner.local(pool, model)]

    def relay(self, model: str) -> RelayCall:
        return replace(self.inner.relay(model), ttft_deadline=self.deadline)

    def budget(self) -> int:
        return int(self.inner.budget())  # type: ignore[attr-defined]


def with_deadline(ask: Any, deadline: float | None) -> Any:
    """`ask` with its TTFT deadline."""
    if deadline is None:
        return ask
    return DeadlineAsk(ask, deadline)
