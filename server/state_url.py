"""`--state-url`: the checks a Valkey/Redis URL must pass at start-up
(settings) before the shared state (server/state_store.py) connects to it."""

from __future__ import annotations

from urllib.parse import urlsplit

SCHEMES = ("redis", "rediss", "unix")


class StateUrlError(ValueError):
    pass


def check_state_url(url: str) -> str:
    """The URL unchanged if redis-py can use it; else StateUrlError with the reason."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as e:
        raise StateUrlError(f"--state-url {url!r}: {e}") from None
    if parts.scheme not in SCHEMES:
        raise StateUrlError(f"--state-url {url!r}: the scheme must be one of redis://, rediss://, unix:// "
                            f"(got {parts.scheme + '://' if parts.scheme else 'none'})")
    if parts.scheme == "unix":
        if not parts.path:
            raise StateUrlError(f"--state-url {url!r}: unix:// needs a socket path (unix:///run/valkey.sock)")
        return url
    if not parts.hostname:
        raise StateUrlError(f"--state-url {url!r}: no host (redis://HOST:PORT/DB)")
    if port == 0:
        raise StateUrlError(f"--state-url {url!r}: port 0")
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        raise StateUrlError(f"--state-url {url!r}: the database must be a number (got {db!r})")
    return url
