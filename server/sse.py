"""Server-sent events framing."""

from __future__ import annotations

from typing import Any

import orjson

from engine_adapter.errors import GatewayError

DONE = b"data: [DONE]\n\n"
KEEP_ALIVE = b": keep-alive\n\n"
SSE_HEADERS = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer this response
}


def event(obj: Any) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def error_event(err: GatewayError) -> bytes:
    """An error after the stream began: an error event (then send DONE)."""
    body = err.to_dict()
    return event(body)
