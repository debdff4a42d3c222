"""Per-key limits: requests per minute, tokens per minute, concurrent
requests. Over a limit: 429 with Retry-After; every response for a limited
key carries OpenAI's x-ratelimit-* headers.

Token use is reserved at admission (prompt + max_tokens, as OpenAI counts it)
and settled to the real count when the request ends.

With `--state-url` the counts live in Valkey/Redis (server/state_store.py)
and hold for every process and replica together; while the store does not
answer, `--state-fail open` counts in this process (as without a store) and
`closed` answers 503 with Retry-After.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine_adapter.errors import GatewayError, RateLimited, ServiceUnavailable
from server.auth import KeyEntry, Principal
from server.metrics import GatewayMetrics

if TYPE_CHECKING:
    from server.state_store import Decision, Hold, StateStore
    from server.usage.budgets import BudgetBook

WINDOW = 60.0


def _reset(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.3g}s"
    m, s = divmod(math.ceil(seconds), 60)
    return f"{m}m{s}s"


@dataclass(slots=True)
class _Usage:
    requests: deque[float] = field(default_factory=deque)
    tokens: deque[list[float]] = field(default_factory=deque)  # [time, amount]
    token_sum: float = 0.0
    concurrent: int = 0

    def trim(self, now: float) -> None:
        while self.requests and now - self.requests[0] >= WINDOW:
            self.requests.popleft()
        while self.tokens and now - self.tokens[0][0] >= WINDOW:
            self.token_sum -= self.tokens.popleft()[1]


class Admission:
    """One admitted request's hold on its key's limits."""

    __slots__ = ("_budget", "_done", "_entry", "_headers", "_hold", "_limits", "_model", "_slot", "_usage")

    def __init__(
        self,
        limits: Limits,
        entry: KeyEntry | None,
        usage: _Usage | None,
        slot: list[float] | None,
        model: str,
        headers: dict[str, str],
        budget: str | None = None,
        hold: Hold | None = None,
    ) -> None:
        self._hold = hold  # its record in the shared store (--state-url)
        self._budget = budget  # the key whose budgets hold this request in flight
        self._limits = limits
        self._entry = entry
        self._usage = usage
        self._slot = slot
        self._model = model
        self._done = False
        self._headers = headers

    def headers(self) -> dict[str, str]:
        return self._headers

    def finish(self, prompt: int, completion: int = 0) -> None:
        if self._done:
            return
        self._done = True
        if self._budget is not None and self._limits.budgets is not None:
            self._limits.budgets.release(self._budget)
        tokens = prompt + completion
        u = self._usage
        if u is not None:
            u.concurrent -= 1
            if self._slot is not None and self._slot in u.tokens:
                u.token_sum += tokens - self._slot[1]
                self._slot[1] = float(tokens)
        if self._hold is not None and self._limits.store is not None:
            self._limits.store.settle(self._hold, tokens)
        name = self._entry.name if self._entry is not None else None
        self._limits.metrics.key_used(name, self._model, prompt, completion)

    def fail(self, err: GatewayError) -> None:
        self.finish(0)


class Limits:
    def __init__(self, metrics: GatewayMetrics, store: StateStore | None = None, fail: str = "open") -> None:
        self.metrics = metrics
        self.store = store  # shared counts (--state-url); None: this process's only
        self.fail_open = fail == "open"
        self._usage: dict[str, _Usage] = {}
        self.budgets: BudgetBook | None = None  # server/usage: per day and month, from the ledger

    async def admit(self, principal: Principal, model: str, tokens: int) -> Admission:
        e = principal.entry
        held: str | None = None
        budget_headers: dict[str, str] = {}
        if e is not None and self.budgets is not None:
            try:
                held, budget_headers = self.budgets.admit(e)  # raises when a budget is spent
            except GatewayError:
                self.metrics.rejected(model, "key_budget")
                raise
        try:
            e = principal.entry
            if self.store is not None and e is not None and (
                e.requests_per_minute or e.tokens_per_minute or e.max_concurrent
            ):
                shared = await self._admit_shared(e, model, tokens, held, budget_headers)
                if shared is not None:
                    return shared
            return self._admit(principal, model, tokens, held, budget_headers)
        except BaseException:
            if held is not None and self.budgets is not None:
                self.budgets.release(held)
            raise

    async def _admit_shared(
        self, e: KeyEntry, model: str, tokens: int, held: str | None, budget_headers: dict[str, str]
    ) -> Admission | None:
        """Through the store; None when it does not answer and `--state-fail open`."""
        store = self.store
        assert store is not None
        if store.available():
            try:
                d, hold = await store.admit(e.name, e.requests_per_minute or 0, e.tokens_per_minute or 0,
                                            e.max_concurrent or 0, tokens, WINDOW)
            except Exception:
                pass  # counted and logged by the store
            else:
                headers = self._shared_headers(e, d)
                if not d.ok:
                    self.metrics.rejected(model, "key_rate_limit")
                    why = {1: f"{e.requests_per_minute} requests per minute",
                           2: f"{e.tokens_per_minute} tokens per minute",
                           3: f"{e.max_concurrent} concurrent requests",
                           4: f"{e.tokens_per_minute} tokens per minute (this request needs {tokens})"}[d.why]
                    retry = max(d.retry, 0.001)
                    raise RateLimited(
                        f"Rate limit reached for key `{e.name}`: {why}. Retry after {math.ceil(retry)}s.",
                        retry_after=retry, headers=headers,
                    )
                self.metrics.key_request(e.name, model)
                return Admission(self, e, None, None, model, {**headers, **budget_headers}, held, hold)
        if self.fail_open:
            return None
        self.metrics.rejected(model, "state_store_down")
        raise ServiceUnavailable(
            "The shared state store that holds this key's limits does not answer; retry shortly.",
            retry_after=1.0,
        )

    @staticmethod
    def _shared_headers(e: KeyEntry, d: Decision) -> dict[str, str]:
        h: dict[str, str] = {}
        if e.requests_per_minute:
            h["x-ratelimit-limit-requests"] = str(e.requests_per_minute)
            h["x-ratelimit-remaining-requests"] = str(max(0, e.requests_per_minute - d.requests))
            h["x-ratelimit-reset-requests"] = _reset(d.requests_reset)
        if e.tokens_per_minute:
            h["x-ratelimit-limit-tokens"] = str(e.tokens_per_minute)
            h["x-ratelimit-remaining-tokens"] = str(max(0, e.tokens_per_minute - d.token_sum))
            h["x-ratelimit-reset-tokens"] = _reset(d.tokens_reset)
        return h

    def _admit(
        self, principal: Principal, model: str, tokens: int, held: str | None, budget_headers: dict[str, str]
    ) -> Admission:
        e = principal.entry
        if e is None or not (e.requests_per_minute or e.tokens_per_minute or e.max_concurrent):
            self.metrics.key_request(principal.name, model)
            return Admission(self, e, None, None, model, budget_headers, held)
        now = time.monotonic()
        u = self._usage.setdefault(e.name, _Usage())
        u.trim(now)
        headers = self._headers(e, u, now)
        retry: float | None = None
        why = ""
        if e.requests_per_minute and len(u.requests) >= e.requests_per_minute:
            retry, why = WINDOW - (now - u.requests[0]), f"{e.requests_per_minute} requests per minute"
        elif e.tokens_per_minute and u.token_sum + tokens > e.tokens_per_minute:
            if tokens > e.tokens_per_minute:
                retry, why = WINDOW, f"{e.tokens_per_minute} tokens per minute (this request needs {tokens})"
            else:
                retry = WINDOW - (now - u.tokens[0][0]) if u.tokens else WINDOW
                why = f"{e.tokens_per_minute} tokens per minute"
        elif e.max_concurrent and u.concurrent >= e.max_concurrent:
            retry, why = 1.0, f"{e.max_concurrent} concurrent requests"
        if retry is not None:
            self.metrics.rejected(model, "key_rate_limit")
            raise RateLimited(
                f"Rate limit reached for key `{e.name}`: {why}. Retry after {math.ceil(retry)}s.",
                retry_after=retry,
                headers=headers,
            )
        u.requests.append(now)
        slot = [now, float(tokens)]
        u.tokens.append(slot)
        u.token_sum += tokens
        u.concurrent += 1
        self.metrics.key_request(e.name, model)
        return Admission(self, e, u, slot, model, {**self._headers(e, u, now), **budget_headers}, held)

    def _headers(self, e: KeyEntry, u: _Usage, now: float) -> dict[str, str]:
        h: dict[str, str] = {}
        if e.requests_per_minute:
            h["x-ratelimit-limit-requests"] = str(e.requests_per_minute)
            h["x-ratelimit-remaining-requests"] = str(max(0, e.requests_per_minute - len(u.requests)))
            h["x-ratelimit-reset-requests"] = _reset(WINDOW - (now - u.requests[0]) if u.requests else 0.0)
        if e.tokens_per_minute:
            h["x-ratelimit-limit-tokens"] = str(e.tokens_per_minute)
            h["x-ratelimit-remaining-tokens"] = str(max(0, int(e.tokens_per_minute - u.token_sum)))
            h["x-ratelimit-reset-tokens"] = _reset(WINDOW - (now - u.tokens[0][0]) if u.tokens else 0.0)
        return h
