"""Budgets per key: tokens and requests per UTC day and month, and an
optional expiry, from the keys file, raised or set at run time
(`PUT /admin/budgets/{key}`, kept in the ledger's database so every replica
and every restart sees them).

Enforced from the ledger at admission, without waiting for the database:
what a key used is the sum the database last reported for it (refreshed
after each batch the ledger writes: every replica's records), plus this
process's records the database had not yet counted then (buffered,
spooled), plus its requests in flight. A key at or over a budget gets 429
before the first byte, with a message naming the budget and its reset time
and `x-ratelimit-*-{budget}` headers. A request admitted under a budget may
take it over by its own tokens: replicas together exceed a budget by at
most their requests in flight and the records not yet visible to each
other (one write and refresh cycle, `--usage-flush-interval`).

With `--state-url` every replica also adds its records to running totals in
Valkey/Redis (per key and day, server/state_store.py) and reads everyone's
back twice a second: what a key used per day is the larger of the two
counts (the ledger's, and the store's), so replicas that keep separate
ledgers still share one budget, and a store that lost its data (restarted
empty) counts nothing short. The ledger stays the record of what happened.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine_adapter.errors import AuthenticationError, RateLimited
from server.auth import BUDGET_NAMES, KeyEntry
from server.usage.periods import DAY, day_of, iso, month_days

PERIOD_OF = {"tokens_per_day": "day", "tokens_per_month": "month", "requests_per_day": "day",
             "requests_per_month": "month"}


def _reset_text(seconds: float) -> str:
    s = max(0, math.ceil(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return (f"{h}h" if h else "") + (f"{m}m" if h or m else "") + f"{s}s"


def counts(rec: dict[str, Any]) -> bool:
    """Whether a record counts as a request against budgets: one that asked
    for a model (generation, embeddings) and was served, failed while
    served, or cancelled; not one refused (4xx but 499, the client leaving)."""
    if rec.get("model") is None:
        return False
    status = rec["status"]
    return bool(status < 400 or status == 499 or status >= 500)


@dataclass(slots=True)
class KeyBudget:
    limits: dict[str, int | None]  # budget name -> limit (None: none)
    expires_at: float | None

    @property
    def any(self) -> bool:
        return any(v is not None for v in self.limits.values())


class BudgetBook:
    """The budgets of every key, what each used, and the check at admission."""

    def __init__(self, entries: list[KeyEntry]) -> None:
        self.entries = {e.name: e for e in entries}
        self.overrides: dict[str, dict[str, int | None]] = {}
        self.effective: dict[str, KeyBudget] = {}
        # from the database: key -> day -> [requests, tokens], days of this month
        self.base: dict[str, dict[int, list[int]]] = {}
        # records not yet in `base`: key -> day -> [requests, tokens]
        self.pending: dict[str, dict[int, list[int]]] = defaultdict(dict)
        self.in_flight: dict[str, int] = defaultdict(int)
        # every replica's records from the shared store (--state-url): key -> day -> [requests, tokens]
        self.shared: dict[str, dict[int, list[int]]] = {}
        self.share: Callable[[str, int, int, int], None] | None = None  # adds a record to the store's totals
        self._written: list[tuple[str, int, int, int]] = []
        self._rebuild()

    # ---- configuration ----
    def _rebuild(self) -> None:
        eff = {}
        for name, e in self.entries.items():
            limits: dict[str, int | None] = {b: getattr(e, b) for b in BUDGET_NAMES}
            expires: float | None = e.expires_at
            for b, v in self.overrides.get(name, {}).items():
                if b == "expires_at":
                    expires = float(v) if v is not None else None
                elif b in limits:
                    limits[b] = v
            kb = KeyBudget(limits, expires)
            if kb.any or kb.expires_at is not None:
                eff[name] = kb
        self.effective = eff

    def set_overrides(self, overrides: dict[str, dict[str, int | None]]) -> None:
        self.overrides = overrides
        self._rebuild()

    def override(self, key: str, values: dict[str, int | None]) -> None:
        self.overrides.setdefault(key, {}).update(values)
        self._rebuild()

    @property
    def tracked(self) -> list[str]:
        return [k for k, b in self.effective.items() if b.any]

    # ---- admission ----
    def check_expiry(self, entry: KeyEntry) -> None:
        b = self.effective.get(entry.name)
        if b is not None and b.expires_at is not None and time.time() >= b.expires_at:
            raise AuthenticationError(f"This API key expired at {iso(b.expires_at)}.", code="key_expired")

    def admit(self, entry: KeyEntry) -> tuple[str | None, dict[str, str]]:
        """Raise RateLimited if a budget of the key is spent; else hold a
        request in flight (give it back with `release(name)`) and return the
        key name to release and the budget headers."""
        b = self.effective.get(entry.name)
        if b is None or not b.any:
            return None, {}
        now = time.time()
        used = self.used(entry.name, now)
        headers: dict[str, str] = {}
        spent: list[tuple[str, int, int, float]] = []
        for name, limit in b.limits.items():
            if limit is None:
                continue
            u = used[name]
            reset = self.resets_at(name, now)
            suffix = name.replace("_", "-")
            headers[f"x-ratelimit-limit-{suffix}"] = str(limit)
            headers[f"x-ratelimit-remaining-{suffix}"] = str(max(0, limit - u))
            headers[f"x-ratelimit-reset-{suffix}"] = _reset_text(reset - now)
            if u >= limit:
                spent.append((name, limit, u, reset))
        if spent:
            name, limit, u, reset = max(spent, key=lambda s: s[3])  # the one that lasts longest
            raise RateLimited(
                f"Budget exhausted for key `{entry.name}`: {name} is {limit} and {u} are used; "
                f"it resets at {iso(reset)}.",
                code="budget_exceeded", retry_after=reset - now, headers=headers,
            )
        self.in_flight[entry.name] += 1
        return entry.name, headers

    def release(self, key: str) -> None:
        self.in_flight[key] -= 1

    @staticmethod
    def resets_at(name: str, now: float) -> float:
        if PERIOD_OF[name] == "day":
            return (day_of(now) + 1) * DAY
        return float(month_days(now)[1] * DAY)

    def used(self, key: str, now: float) -> dict[str, int]:
        today = day_of(now)
        first, nxt = month_days(now)
        req_d = tok_d = req_m = tok_m = 0
        days: dict[int, list[int]] = {}
        for src in (self.base.get(key), self.pending.get(key)):
            for day, (r, t) in (src or {}).items():
                slot = days.setdefault(day, [0, 0])
                slot[0] += r
                slot[1] += t
        for day, (r, t) in self.shared.get(key, {}).items():  # the larger count of each day
            slot = days.setdefault(day, [0, 0])
            slot[0], slot[1] = max(slot[0], r), max(slot[1], t)
        for day, (r, t) in days.items():
            if first <= day < nxt:
                req_m += r
                tok_m += t
                if day == today:
                    req_d += r
                    tok_d += t
        fl = self.in_flight.get(key, 0)
        return {"tokens_per_day": tok_d, "tokens_per_month": tok_m,
                "requests_per_day": req_d + fl, "requests_per_month": req_m + fl}

    # ---- accounting ----
    def recorded(self, key: str, ts: float, requests: int, tokens: int) -> None:
        """A finished request's record (buffered: not in the database yet)."""
        if key not in self.effective:
            return
        day = day_of(ts)
        slot = self.pending[key].setdefault(day, [0, 0])
        slot[0] += requests
        slot[1] += tokens
        if self.share is not None:
            self.share(key, day, requests, tokens)

    def written(self, rows: list[tuple[str, int, int, int]]) -> None:
        """(key, day, requests, tokens) now in the database."""
        self._written.extend(r for r in rows if r[0] in self.effective)

    def take_written(self) -> list[tuple[str, int, int, int]]:
        """Before a refresh's query: the writes it will see."""
        w, self._written = self._written, []
        return w

    def put_back(self, rows: list[tuple[str, int, int, int]]) -> None:
        self._written = rows + self._written

    def refreshed(self, base: dict[str, dict[int, list[int]]], seen: list[tuple[str, int, int, int]]) -> None:
        """The database's sums (queried after `seen` was written)."""
        self.base = base
        for key, day, r, t in seen:
            slot = self.pending.get(key, {}).get(day)
            if slot is not None:
                slot[0] -= r
                slot[1] -= t
        first, _ = month_days(time.time())
        for days in self.pending.values():
            for d in [d for d, v in days.items() if d < first or v == [0, 0]]:
                del days[d]

    # ---- reading ----
    def report(self, key: str) -> dict[str, Any]:
        """The `GET /admin/budgets` entry of a key."""
        now = time.time()
        b = self.effective.get(key)
        used = self.used(key, now)
        out = []
        if b is not None:
            for name, limit in b.limits.items():
                if limit is not None:
                    out.append({"name": name, "limit": limit, "used": used[name],
                                "resets_at": iso(self.resets_at(name, now))})
        return {"key": key, "expires_at": iso(b.expires_at) if b and b.expires_at is not None else None,
                "budgets": out}
