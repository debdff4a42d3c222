"""Run engine streams for the routes: several streams merged (n prompts),
non-streamed collection that aborts when the client goes away, and the SSE
body wrapper that turns errors into an error event then `[DONE]`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine_adapter.errors import EngineError, GatewayError
from engine_adapter.types import EngineOutput
from server import sse

logger = logging.getLogger(__name__)
T = TypeVar("T")

Batches = AsyncIterator[list[EngineOutput] | None]


async def merge(streams: list[tuple[int, Batches]]) -> AsyncIterator[tuple[int, list[EngineOutput] | None]]:
    """Interleave several streams of batches, tagging each with its stream's tag."""
    if len(streams) == 1:
        tag, only = streams[0]
        async for item in only:
            yield tag, item
        return
    queue: asyncio.Queue[tuple[int, list[EngineOutput] | None] | BaseException | None] = asyncio.Queue()

    async def pump(tag: int, s: Batches) -> None:
        try:
            async for item in s:
                queue.put_nowait((tag, item))
            queue.put_nowait(None)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            queue.put_nowait(e)

    tasks = [asyncio.ensure_future(pump(tag, s)) for tag, s in streams]
    try:
        live = len(tasks)
        while live:
            got = await queue.get()
            if got is None:
                live -= 1
                continue
            if isinstance(got, BaseException):
                raise got
            yield got
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (so the engine request is aborted) if the
    client disconnects first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise asyncio.CancelledError("client disconnected")
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()


class SSEResponse(StreamingResponse):
    """StreamingResponse with the client-disconnect watch on plain asyncio
    tasks instead of an anyio task group (a measurable share of a short
    stream's CPU). As Starlette's: a disconnect cancels the body iterator
    (so the engine request is aborted) and ends the response quietly."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        stream = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait((stream, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, watcher):
                task.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
        error = None if stream.cancelled() else stream.exception()
        if error is not None:
            raise error
        if self.background is not None:
            await self.background()


def sse_response(body: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> StreamingResponse:
    h = dict(sse.SSE_HEADERS)
    if headers:
        h.update(headers)
    return SSEResponse(body, media_type="text/event-stream", headers=h)


async def guarded(
    events: AsyncIterator[bytes],
    on_error: Callable[[GatewayError], None] | None = None,
) -> AsyncIterator[bytes]:
    """Errors once a stream has begun go inside the stream: an error event,
    then `data: [DONE]`. Never a cut connection without a word."""
    try:
        async for chunk in events:
            yield chunk
    except GatewayError as e:
        if on_error is not None:
            on_error(e)
        yield sse.error_event(e)
        yield sse.DONE
    except Exception:
        logger.exception("stream failed")
        yield sse.error_event(EngineError("internal error while streaming; see the gateway log"))
        yield sse.DONE
