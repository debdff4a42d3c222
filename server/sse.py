"""Server-sent events framing."""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer this response
}


def event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class Frames:
    """Chunk events with a fixed head (id, object, created, model) encoded
    once: `choice(c)` is `event({**head, "choices": [c]})`, byte for byte."""

    __slots__ = ("_prefix",)

    def __init__(self, head: dict[str, Any]) -> None:
        self._prefix = b""
        self.set_head(head)

    def set_head(self, head: dict[str, Any]) -> None:
        self._prefix = b"data: " + orjson.dumps(head)[:-1] + b',"choices":['

    def choice(self, c: dict[str, Any]) -> bytes:
        return self._prefix + orjson.dumps(c) + b"]}\n\n"
