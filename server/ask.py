"""What a generating route asks of the target admission picks (the Ask of
engine_adapter/lease.py): the same client request, as engine requests for a
local engine (validated and tokenized with that engine's tokenizer, once
per tokenizer) or as one pass-through call for upstream nodes (the client's
JSON body, untouched)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import orjson

from engine_adapter.types import GenerationRequest, RelayCall


def engine_trace(headers: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """The W3C trace context among the headers a request forwards."""
    return tuple((k, v) for k, v in headers if k in ("traceparent", "tracestate"))


@dataclass(frozen=True, slots=True)
class Caller:
    """Who asks, and until when, alike for every API (server/caller.py
    `caller_of`): the request's priority, the deadline of the whole request,
    the key's name, and the headers it forwards (a trace context)."""

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
