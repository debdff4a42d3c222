"""OpenAPI `responses` shared by the routes, so the published schema names
every status and content type the gateway answers with."""

from __future__ import annotations

from typing import Any

from server.protocol import ErrorResponse

ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorResponse} for s in (400, 401, 403, 404, 405, 413, 415, 429, 500, 503, 504)
}
JSON_OR_SSE: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {
        "description": "A JSON response, or a server-sent event stream when `stream` is true",
        "content": {"application/json": {}, "text/event-stream": {}},
    },
}
TEXT: dict[int | str, dict[str, Any]] = {
    **ERRORS,
    200: {"description": "Prometheus text format", "content": {"text/plain": {}}},
}
