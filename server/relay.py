"""Answers passed through from upstream nodes (the gateway tier): the
node's bytes, relayed as they come, with the status line held until the
first of them so that every failure before it (the node refused, timed out,
was ejected; an alias moved on to its next target) is a status."""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from engine_adapter.errors import EngineError, GatewayError
from engine_adapter.lease import Relayed
from engine_adapter.types import RelayCall, RelayUsage
from server import sse
from server.errors import error_response
from server.generation import Generation, SSEResponse, note_outcome, openai_stream_error, until_disconnect


async def first_bytes(items: AsyncGenerator[Relayed, None], gen: Generation) -> bytes:
    """The first bytes of a relayed answer (usage before them is taken)."""
    async for item in items:
        if isinstance(item, RelayUsage):
            gen.took(item)
        else:
            gen.note.setdefault("t_first", time.perf_counter())
            return item
    return b""


async def relay_response(request: Request, gen: Generation) -> Response:
    call = gen.lease.requests[0]
    assert isinstance(call, RelayCall)
    items = gen.lease.relay()
    try:
        first = await until_disconnect(request, first_bytes(items, gen))
    except BaseException:
        await items.aclose()
        gen.finish()
        raise
    if not call.stream:
        try:
            async for item in items:
                if isinstance(item, RelayUsage):
                    gen.took(item)
        finally:
            await items.aclose()
            gen.finish()
        return Response(first, media_type="application/json", headers=gen.headers())

    async def body() -> AsyncIterator[bytes]:
        try:
            yield first
            async for item in items:
                if isinstance(item, RelayUsage):
                    gen.took(item)
                else:
                    yield item
        except GatewayError as e:
            note_outcome(gen.note, "error")
            yield openai_stream_error(e if isinstance(e, EngineError) else EngineError(e.message, code=e.code))
        finally:
            await items.aclose()
            gen.finish()

    return SSEResponse(body(), gen, None, error_response, primed=True, media_type="text/event-stream",
                       headers=dict(sse.SSE_HEADERS))
