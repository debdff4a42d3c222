"""Answers passed through from upstream nodes (the gateway tier): the
node's bytes, relayed as they come, with the status line held until the
first of them so that every failure before it (the node refused, timed out,
was ejected; an alias moved on to its next target) is a status.

`RelayAnswer` is the one writer of such an answer, for the short path
(server/fast_relay.py) and every API's route alike:

    answer = RelayAnswer(gen, stream=..., failed=..., view=..., path=...)
    await answer.start()      # before the status line: a failure is the status
    return answer             # (or `await answer(scope, receive, send)`)

`start` takes the usage the node reports, and for an answer that is not
streamed reads it whole. Writing it streams the rest under the request's
disconnect watch (server/disconnect.py); an error after the first byte ends
the stream with `failed(err)`, the API's own error event. A `view` renders
the node's chat (or completions) chunks in the route's API when the request
was translated for the node (server/relay_apis.py). The generation is
finished (slot released, tokens settled) however the answer ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from engine_adapter.errors import EngineError, GatewayError
from engine_adapter.lease import Relayed
from engine_adapter.types import RelayCall, RelayUsage
from server.disconnect import until_disconnect, watched
from server.generation import RelayGeneration, note_outcome, openai_stream_error
from server.render import SSE_HEADERS

logger = logging.getLogger(__name__)

_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream; charset=utf-8")] + [
    (k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in SSE_HEADERS.items()
]
Estimate = Callable[[RelayCall, bytes], tuple[int, int]]


class DeltaView(Protocol):
    """A route's renderer fed with chat (or completions) deltas."""

    def head(self) -> bytes: ...

    def feed(self, delta: dict[str, Any], finish_reason: str | None, stop_reason: str | int | None) -> bytes: ...

    def tail(self) -> bytes: ...

    def whole(self) -> dict[str, Any]: ...

    def failed(self, err: GatewayError) -> bytes: ...


async def first_bytes(items: AsyncGenerator[Relayed, None], gen: RelayGeneration) -> bytes:
    """The first bytes of a relayed answer (usage before them is taken)."""
    async for item in items:
        if isinstance(item, RelayUsage):
            gen.took(item)
        else:
            gen.note.setdefault("t_first", time.perf_counter())
            return item
    return b""


def _as_engine_error(e: GatewayError) -> EngineError:
    return e if isinstance(e, EngineError) else EngineError(e.message, code=e.code)


class RelayAnswer(Response):
    """One relayed answer (see the module's doc). A Starlette `Response`
    that writes itself: a route returns it, the short path calls it."""

    def __init__(
        self,
        gen: RelayGeneration,
        *,
        stream: bool,
        failed: Callable[[GatewayError], bytes] = openai_stream_error,
        view: DeltaView | None = None,
        path: str | None = None,
        estimate: Estimate | None = None,
        media_type: str = "text/event-stream",
    ) -> None:
        # Response.__init__ is not called: the answer writes its own messages
        self.gen = gen
        self.stream = stream
        self.failed = failed
        self.view = view
        self.path = path  # the API's own path: a call elsewhere was translated (rendered by `view`)
        self.estimate = estimate
        self.stream_type = media_type  # a stream's (SSE, or /generate's NDJSON)
        self.items = gen.lease.relay()
        self.first = b""
        self.last = b""
        self.body = b""  # a whole answer's, once started
        self.background = None
        self.status_code = 200

    @property
    def call(self) -> RelayCall:
        """The call that answers (an alias may have moved on before the first byte)."""
        return self.gen.call

    @property
    def translated(self) -> bool:
        return self.view is not None and self.call.path != self.path

    async def start(self) -> None:
        """Everything before the status line: the first bytes, and all of an
        answer that is not streamed. A failure finishes the generation and
        is raised (the request's status)."""
        try:
            self.first = self.last = await first_bytes(self.items, self.gen)
            if not self.stream:
                self.body = await self._whole()
                await self.close()
        except BaseException:
            await self.close()
            raise

    async def _whole(self) -> bytes:
        if not self.translated:
            async for item in self.items:
                if isinstance(item, RelayUsage):
                    self.gen.took(item)
            return self.first
        view = self.view
        assert view is not None
        if not self.call.stream:  # a whole answer (count_tokens' /tokenize)
            raw = b"".join([self.first, *[i async for i in self.items if isinstance(i, bytes)]])
            from_raw = getattr(view, "from_raw", None)
            return orjson.dumps(view.whole() if from_raw is None else from_raw(raw))
        async for _ in self._rendered():
            pass
        return orjson.dumps(view.whole())

    async def close(self) -> None:
        """Close the node's answer, then finish the generation. Idempotent."""
        await self.items.aclose()
        if self.estimate is not None and not self.translated and not self.gen.completion_tokens:
            self.gen.prompt_tokens, self.gen.completion_tokens = self.estimate(self.call, self.last)
        self.gen.finish()

    def _gen_headers(self) -> list[tuple[bytes, bytes]]:
        return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.gen.headers().items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if not self.stream:
            body = self.body
            headers = [*self._gen_headers(), _JSON, (b"content-length", b"%d" % len(body))]
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            await send({"type": "http.response.body", "body": body})
        else:
            await self._send_stream(scope, receive, send)
        if self.background is not None:
            await self.background()

    async def _send_stream(self, scope: Scope, receive: Receive, send: Send) -> None:
        gen = self.gen
        watch, own = watched(scope, receive)
        head = _SSE if self.stream_type == "text/event-stream" else [(b"content-type", self.stream_type.encode())]
        try:
            try:
                await send({"type": "http.response.start", "status": 200, "headers": head + self._gen_headers()})
                if self.translated:
                    async for part in self._translated():
                        await send({"type": "http.response.body", "body": part, "more_body": True})
                else:  # the node's bytes as they come (no generator between: a chunk's CPU counts here)
                    await send({"type": "http.response.body", "body": self.first, "more_body": True})
                    async for item in self.items:
                        if isinstance(item, RelayUsage):
                            gen.took(item)
                        else:
                            self.last = item
                            await send({"type": "http.response.body", "body": item, "more_body": True})
            except GatewayError as e:  # after the first byte: the API's error event ends the stream
                note_outcome(gen.note, "error")
                err = e if self.translated else _as_engine_error(e)
                await send({"type": "http.response.body", "body": self._failed(err), "more_body": True})
            except Exception:
                logger.exception("relayed stream failed")
                note_outcome(gen.note, "error")
                err = EngineError("internal error while streaming; see the gateway log")
                await send({"type": "http.response.body", "body": self._failed(err), "more_body": True})
            finally:
                await self.close()
            await send({"type": "http.response.body", "body": b""})
        except asyncio.CancelledError:
            if not watch.left():
                raise
            note_outcome(gen.note, "cancelled")  # the client left mid-stream
        finally:
            if own:
                watch.stop()

    def _failed(self, err: GatewayError) -> bytes:
        return self.view.failed(err) if self.view is not None else self.failed(err)

    async def _translated(self) -> AsyncIterator[bytes]:
        """The node's chunks rendered by the view, between its head and tail."""
        view = self.view
        assert view is not None
        yield view.head()
        async for part in self._rendered():
            yield part
        yield view.tail()

    async def _rendered(self) -> AsyncIterator[bytes]:
        view = self.view
        assert view is not None
        call = self.call
        data: bytes | None = self.first
        while data is not None:
            for d, reason, stop in deltas(data, call):
                out = view.feed(d, reason, stop)
                if out:
                    yield out
            data = None
            async for item in self.items:
                if isinstance(item, RelayUsage):
                    self.gen.took(item)
                else:
                    data = item
                    break


def deltas(data: bytes, call: RelayCall) -> list[tuple[dict[str, Any], str | None, str | int | None]]:
    """The deltas in a read of the node's chat (or completions) stream:
    (delta, finish_reason, stop_reason); a choice past the first is named
    in the delta's `_choice`."""
    out = []
    for line in data.split(b"\n"):
        if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
            continue
        try:
            event = orjson.loads(line[5:])
        except ValueError:
            raise EngineError(f"upstream {call.model!r} sent a malformed event", code="upstream_error") from None
        if event.get("error"):
            err = event["error"]
            msg = err.get("message") if isinstance(err, dict) else err
            raise EngineError(f"upstream {call.model!r}: {msg}", code="upstream_error")
        for c in event.get("choices") or ():
            delta = c.get("delta")
            if delta is None:  # completions
                delta = {"content": c.get("text") or ""}
            index = int(c.get("index") or 0)
            out.append(({**delta, "_choice": index} if index else delta, c.get("finish_reason"),
                        c.get("stop_reason")))
    return out


async def relay_response(request: Request, gen: RelayGeneration) -> Response:
    """The answer of a passed-through chat, completions or embeddings request."""
    answer = RelayAnswer(gen, stream=gen.call.stream)
    await until_disconnect(request, answer.start())
    return answer
