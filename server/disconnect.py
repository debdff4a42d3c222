"""The one client-disconnect watcher.

A `Watch` reads the request's `receive` until the client disconnects, then
cancels the task serving the request, so whatever it awaits (a queue wait,
a node's first byte, an engine stream) is given up at once and the engine
request is aborted. It is armed for a span of the request:

- the whole request on the short path (server/fast_relay.py puts it in
  `scope["state"]["watch"]`); every span below then runs under it;
- else one `until_disconnect` wait, or one response body (`watched`: SSE
  streams, relayed answers).

The serving task tells the watch's cancellation from any other one (a
shutdown) with `Watch.left()`: only the watch's own is swallowed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive, Scope

from server.errors import ClientDisconnected

T = TypeVar("T")


class Watch:
    """Cancels the task that made it when the client disconnects, while
    armed (from its making to `stop`)."""

    __slots__ = ("armed", "gone", "task", "watcher")

    def __init__(self, receive: Receive) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.task = task
        self.armed = True
        self.gone = False
        self.watcher = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        if self.armed:  # else the answer was complete (uvicorn reports that as a disconnect too)
            self.gone = True
            self.task.cancel("client disconnected")

    def left(self) -> bool:
        """In an `except CancelledError` of the watched task: whether the
        cancellation is this watch's alone (the client left), which it then
        takes back; False for any other (re-raise it)."""
        return self.gone and self.task.uncancel() == 0

    def stop(self, answered: bool = False) -> None:
        """Disarm. `answered`: the response is complete, so the watcher's
        receive returns by itself (uvicorn then reports a disconnect) and it
        ends on its next step; cancelling it would throw through its frames,
        a measurable share of a short request's CPU. Else it is cancelled."""
        self.armed = False
        if not answered:
            self.watcher.cancel()


def armed(scope: Scope) -> Watch | None:
    """The watch armed for the whole request (the short path), if any."""
    state = scope.get("state")
    watch: Watch | None = state.get("watch") if state is not None else None
    return watch if watch is not None and watch.armed else None


def watched(scope: Scope, receive: Receive) -> tuple[Watch, bool]:
    """The watch for a response body: the request's, else a new one (True:
    the caller's own, to `stop`)."""
    watch = armed(scope)
    return (watch, False) if watch is not None else (Watch(receive), True)


async def until_disconnect(
    request: Request, work: Awaitable[T], discard: Callable[[T], None] | None = None
) -> T:
    """Await `work`; if the client disconnects first, it is cancelled (so an
    engine request is aborted, or a queue wait given up) and
    `ClientDisconnected` raised. `discard` undoes a result that came though
    the client had left (work that did not take its cancellation)."""
    if armed(request.scope) is not None:
        return await work  # the request's watch cancels this task if the client leaves
    watch = Watch(request.receive)
    try:
        result = await work
    except asyncio.CancelledError:
        if watch.left():
            raise ClientDisconnected("client disconnected") from None
        raise
    finally:
        watch.stop()
    if watch.gone:  # the work swallowed the cancellation: the client is gone all the same
        watch.task.uncancel()
        if discard is not None:
            discard(result)
        raise ClientDisconnected("client disconnected")
    return result
