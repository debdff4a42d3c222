"""API keys: `--api-key` (repeatable) and a YAML keys file holding the
SHA-256 of each key (never the key), with per-key limits.

Keys are accepted as `Authorization: Bearer`, `api-key` or `x-api-key`, and
compared in constant time. A key itself is never logged.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass
from datetime import date, datetime, timezone
from pathlib import Path
from typing import Annotated, Any

import yaml
from fastapi import Depends, Request
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from engine_adapter.errors import AuthenticationError, PermissionDenied
from server.settings import Settings


@dataclass(frozen=True, slots=True)
class KeyEntry:
    name: str
    sha256: str
    models: frozenset[str] | None = None  # None: every model
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    max_concurrent: int | None = None
    priority: int | None = None
    admin: bool = False
    # budgets (server/usage/budgets.py), enforced from the usage ledger
    tokens_per_day: int | None = None
    tokens_per_month: int | None = None
    requests_per_day: int | None = None
    requests_per_month: int | None = None
    expires_at: float | None = None  # seconds since 1970 (UTC)
    # fair share (engine_adapter/scheduler.py): this key's share of the slots
    # inside one priority, relative to the others (default 1)
    weight: float = 1.0
    ttft_deadline_ms: float | None = None  # default x-ttft-deadline-ms of its requests


BUDGET_NAMES = ("tokens_per_day", "tokens_per_month", "requests_per_day", "requests_per_month")


@dataclass(frozen=True, slots=True)
class Principal:
    name: str | None  # None: no client keys configured (open server)
    entry: KeyEntry | None = None
    open_admin: bool = False  # open server without an admin key: admin routes open too

    def check_model(self, model: str) -> None:
        if self.entry is not None and self.entry.models is not None and model not in self.entry.models:
            raise PermissionDenied(
                f"this API key may not use the model `{model}`", param="model"
            )

    def priority_for(self, requested: int, explicit: bool) -> int:
        """The request's own `priority` if it sent one, else its key's default."""
        if explicit or self.entry is None or self.entry.priority is None:
            return requested
        return self.entry.priority

    @property
    def admin(self) -> bool:
        return self.entry.admin if self.entry is not None else self.open_admin


def sha256_hex(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


class _KeyFileEntry(BaseModel):
    """One entry of the keys file, exactly as written (no coercion: `"60"` is
    not a number, `models: sim` is not a list)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1)
    sha256: str = Field(pattern=r"^[0-9a-fA-F]{64}$")
    models: list[str] | None = None
    requests_per_minute: PositiveInt | None = None
    tokens_per_minute: PositiveInt | None = None
    max_concurrent: PositiveInt | None = None
    priority: int | None = None
    admin: bool = False
    tokens_per_day: PositiveInt | None = None
    tokens_per_month: PositiveInt | None = None
    requests_per_day: PositiveInt | None = None
    requests_per_month: PositiveInt | None = None
    # a date (the key stops working at 00:00 UTC that day) or a date and time
    # (UTC unless it says otherwise); YAML reads either unquoted, a string works too
    expires_at: datetime | date | None = None
    weight: float = Field(1.0, gt=0, allow_inf_nan=False)
    ttft_deadline_ms: float | None = Field(None, gt=0, allow_inf_nan=False)

    @field_validator("expires_at", mode="before")
    @classmethod
    def _when(cls, v: Any) -> Any:
        if isinstance(v, str):
            return parse_when(v)
        return v


def parse_when(v: str) -> datetime:
    """`2026-12-31` or an ISO 8601 date and time -> an aware datetime (UTC
    when no offset is given); raises ValueError."""
    text = v.strip()
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"{v!r} is not an ISO 8601 date or date and time") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


def epoch_of(when: datetime | date | None) -> float | None:
    if when is None:
        return None
    if not isinstance(when, datetime):
        when = datetime(when.year, when.month, when.day)
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


class KeysFileError(ValueError):
    """A keys file that cannot be used: names the file, the entry and the field."""


def load_keys_file(path: Path) -> list[KeyEntry]:
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise KeysFileError(f"{path}: cannot read the keys file: {e}") from None
    raw = data.get("keys", data) if isinstance(data, dict) else data
    if not isinstance(raw, list):
        raise KeysFileError(f"{path}: expected a list of keys under `keys:`")
    out = []
    for i, item in enumerate(raw):
        label = f"key #{i + 1}" + (f" ({item['name']!r})" if isinstance(item, dict) and "name" in item else "")
        if not isinstance(item, dict):
            raise KeysFileError(f"{path}: {label}: expected a mapping with `name` and `sha256`")
        try:
            k = _KeyFileEntry.model_validate(item)
        except ValidationError as err:
            problems = "; ".join(
                f"field `{'.'.join(map(str, x['loc'])) or '?'}`: {x['msg']}" for x in err.errors()
            )
            raise KeysFileError(f"{path}: {label}: {problems}") from None
        out.append(
            KeyEntry(
                name=k.name,
                sha256=k.sha256.lower(),
                models=frozenset(k.models) if k.models else None,
                requests_per_minute=k.requests_per_minute,
                tokens_per_minute=k.tokens_per_minute,
                max_concurrent=k.max_concurrent,
                priority=k.priority,
                admin=k.admin,
                tokens_per_day=k.tokens_per_day,
                tokens_per_month=k.tokens_per_month,
                requests_per_day=k.requests_per_day,
                requests_per_month=k.requests_per_month,
                expires_at=epoch_of(k.expires_at),
                weight=k.weight,
                ttft_deadline_ms=k.ttft_deadline_ms,
            )
        )
    names = [e.name for e in out]
    if len(set(names)) != len(names):
        raise KeysFileError(f"{path}: a key name is used twice")
    return out


class KeyStore:
    def __init__(self, entries: list[KeyEntry], metrics_key: str | None = None) -> None:
        self.entries = entries  # fixed from here on: read on every request, so summed up once
        self._open = not any(e.name != "admin" or not e.admin for e in entries)
        self._has_admin = any(e.admin for e in entries)
        self._metrics_digest = sha256_hex(metrics_key) if metrics_key else None

    @classmethod
    def from_settings(cls, s: Settings) -> KeyStore:
        entries = [
            KeyEntry(name=f"key-{i + 1}", sha256=sha256_hex(k), admin=s.admin_api_key is None)
            for i, k in enumerate(s.api_key)
        ]
        if s.admin_api_key:
            entries.append(KeyEntry(name="admin", sha256=sha256_hex(s.admin_api_key), admin=True))
        if s.api_keys_file is not None:
            entries.extend(load_keys_file(s.api_keys_file))
        return cls(entries, s.metrics_api_key)

    @property
    def open(self) -> bool:
        """No client keys: the API routes are open (an admin key alone still
        guards the admin routes)."""
        return self._open

    @property
    def has_admin_key(self) -> bool:
        return self._has_admin

    def lookup(self, key: str) -> KeyEntry | None:
        digest = sha256_hex(key)
        found = None
        for e in self.entries:  # no early exit: constant time over the list
            if hmac.compare_digest(digest, e.sha256):
                found = e
        return found

    def metrics_allowed(self, key: str | None) -> bool:
        if self._metrics_digest is None:
            return True
        return key is not None and hmac.compare_digest(sha256_hex(key), self._metrics_digest)


def key_from_headers(request: Request) -> str | None:
    h = request.headers
    auth = h.get("authorization")
    if auth:
        scheme, _, value = auth.partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
    return h.get("api-key") or h.get("x-api-key")


async def authenticate(request: Request) -> Principal:
    store: KeyStore = request.app.state.keys
    if store.open:
        return Principal(name=None, open_admin=not store.has_admin_key)
    key = key_from_headers(request)
    if key is None:
        raise AuthenticationError(
            "You didn't provide an API key. Pass it as `Authorization: Bearer KEY`."
        )
    entry = store.lookup(key)
    if entry is None:
        raise AuthenticationError("Incorrect API key provided.")
    request.scope.setdefault("state", {})["key"] = entry.name  # the record's key, refused requests too
    budgets = getattr(request.app.state, "budgets", None)  # server/usage: expiry may be changed at run time
    if budgets is not None:
        budgets.check_expiry(entry)
    return Principal(name=entry.name, entry=entry)


AuthDep = Annotated[Principal, Depends(authenticate)]


async def require_admin(request: Request) -> Principal:
    store: KeyStore = request.app.state.keys
    # The console's session cookie (server/console/sessions.py) stands for
    # the admin key on reads, so the console's page never holds the key.
    session = getattr(request.app.state, "admin_session", None)
    if session is not None and request.method in ("GET", "HEAD") and key_from_headers(request) is None:
        p: Principal | None = session(request)
        if p is not None:
            return p
    if store.open and store.has_admin_key:
        key = key_from_headers(request)
        entry = store.lookup(key) if key is not None else None
        if entry is None:
            raise AuthenticationError("this route needs the admin API key")
        p = Principal(name=entry.name, entry=entry)
    else:
        p = await authenticate(request)
    if not p.admin:
        raise PermissionDenied("this route needs an admin API key", code="admin_required")
    return p
