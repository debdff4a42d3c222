"""Console sessions: the admin key is typed once into the login form and
exchanged for a random token kept in this process's memory; the browser
holds only the token, in an HttpOnly, SameSite=Strict cookie. The key is
never stored, logged, or written into a page.

A session lasts `ttl` seconds from its last use; logout forgets it. At most
`max_sessions` live at once (the oldest goes first). Sessions are per
process: a restart (or another `--workers` process) asks for the key again.
"""

from __future__ import annotations

import hmac
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import Request

from server.auth import KeyStore, Principal

COOKIE = "npugw_console"


@dataclass(slots=True)
class _Session:
    principal: Principal
    last_used: float


class Sessions:
    def __init__(
        self, ttl: float = 8 * 3600.0, max_sessions: int = 256, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.ttl = ttl
        self.max_sessions = max_sessions
        self._clock = clock
        self._by_token: OrderedDict[str, _Session] = OrderedDict()

    def login(self, keys: KeyStore, key: str) -> str | None:
        """A new session token for an admin key, or None (wrong key, or a
        key that is not an admin key)."""
        entry = keys.lookup(key) if key else None
        if entry is None or not entry.admin:
            return None
        self._prune()
        while len(self._by_token) >= self.max_sessions:
            self._by_token.popitem(last=False)
        token = secrets.token_urlsafe(32)
        self._by_token[token] = _Session(Principal(name=entry.name, entry=entry), self._clock())
        return token

    def principal(self, token: str | None) -> Principal | None:
        if not token:
            return None
        now = self._clock()
        found = None
        for t, s in self._by_token.items():  # compared in constant time, as keys are
            if hmac.compare_digest(t, token):
                found = t, s
        if found is None:
            return None
        t, s = found
        if now - s.last_used > self.ttl:
            del self._by_token[t]
            return None
        s.last_used = now
        self._by_token.move_to_end(t)
        return s.principal

    def logout(self, token: str | None) -> None:
        if token:
            for t in [t for t in self._by_token if hmac.compare_digest(t, token)]:
                del self._by_token[t]

    def _prune(self) -> None:
        now = self._clock()
        for t in [t for t, s in self._by_token.items() if now - s.last_used > self.ttl]:
            del self._by_token[t]

    def from_request(self, request: Request) -> Principal | None:
        return self.principal(request.cookies.get(COOKIE))

    def __len__(self) -> int:
        return len(self._by_token)
