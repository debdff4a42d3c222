"""The other client APIs (Responses, Messages, /generate) for upstream nodes.

A node that serves the API gets the client's request as it came (only
`model` set to the node's id) and the client gets the node's answer, with
its statuses before the first byte and its errors in the API's shape. A node
that does not is sent the route's translation (chat, or completions for
`/generate`), always streamed, and the route renders the node's chat chunks
in its API's shape (`DeltaView`). Which one happens is known only once the
node answered: an alias may move a request to another target before its
first byte.

Usage for accounting comes from the node's answer (server side: Responses'
and Anthropic's usage; engine side: engine_adapter/backends/api_relay.py);
/generate answers carry no counts, so a token per four bytes of the prompt
and of the text stands in for them.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol

import orjson
from starlette.requests import Request
from starlette.responses import Response

from engine_adapter.errors import EngineError, GatewayError
from engine_adapter.lease import Relayed
from engine_adapter.routing.upstream import upstreams_of
from engine_adapter.types import GenerationRequest, RelayCall, RelayUsage
from server import sse
from server.ask import RouteAsk
from server.errors import error_response
from server.generation import Generation, SSEResponse, until_disconnect
from server.relay import first_bytes
from server.state import Gateway


def has_api(gw: Gateway, target: str, api: str) -> bool:
    """Whether the upstream nodes behind served name `target` serve `api`."""
    model = gw.base_models.get(target)
    ups = upstreams_of([model.pool]) if model is not None else []
    return bool(ups) and api in ups[0].apis


class ApiAsk(RouteAsk):
    """A request of one of these APIs: for a local engine, `build(pool)`
    (the route's translation, tokenized with that engine's tokenizer); for
    nodes that serve `api`, the client's body at `path`; for nodes that do
    not, `translate(model)` sent to `via` (chat or completions), streamed."""

    def __init__(
        self,
        raw: bytes,
        *,
        gw: Gateway,
        api: str,
        path: str,
        via: str,
        build: Callable[[Any], list[GenerationRequest]],
        translate: Callable[[], dict[str, Any]],
        native: bool = True,
        via_stream: bool = True,
        **kw: Any,
    ) -> None:
        super().__init__(raw, **kw)
        self.gw = gw
        self.api = api
        self.path = path
        self.via = via
        self._build = build
        self._translate = translate
        self.native = native  # False: always translate (a chain stored here)
        self.via_stream = via_stream

    def build(self, pool: Any) -> list[GenerationRequest]:
        return self._build(pool)

    def relay(self, model: str) -> RelayCall:
        if self.native and has_api(self.gw, model, self.api):
            return super().relay(model)
        body = {**self._translate(), "model": model}
        if self.via_stream:
            body["stream"] = True
        return RelayCall(
            request_id=self.request_id, model=model, path=self.via, body=body, stream=self.via_stream,
            want_usage=False,
            priority=self.priority, deadline=self.deadline, api_key_name=self.api_key_name, headers=self.forward,
        )


class DeltaView(Protocol):
    """A route's renderer fed with chat (or completions) deltas."""

    def head(self) -> bytes: ...

    def feed(self, delta: dict[str, Any], finish_reason: str | None, stop_reason: str | int | None) -> bytes: ...

    def tail(self) -> bytes: ...

    def whole(self) -> dict[str, Any]: ...

    def failed(self, err: GatewayError) -> bytes: ...


async def relayed_response(
    request: Request,
    gen: Generation,
    path: str,
    view: DeltaView,
    *,
    stream: bool,
    media_type: str = "text/event-stream",
    estimate: Callable[[RelayCall, bytes], tuple[int, int]] | None = None,
) -> Response:
    """The answer of a relayed request: the node's own (passed through), or
    its chat chunks rendered by `view` (translated). `estimate(call, last
    bytes)`: (prompt, completion) tokens when the node gave no usage."""
    items = gen.lease.relay()
    try:
        first = await until_disconnect(request, first_bytes(items, gen))
    except BaseException:
        await items.aclose()
        gen.finish()
        raise
    call = gen.lease.requests[0]
    assert isinstance(call, RelayCall)
    if call.path != path:
        return await _translated(request, gen, call, view, first, items, stream, media_type)

    def settle(last: bytes) -> None:
        if estimate is not None and not gen.completion_tokens:
            gen.prompt_tokens, gen.completion_tokens = estimate(call, last)
        gen.finish()

    if not stream:
        try:
            async for item in items:
                if isinstance(item, RelayUsage):
                    gen.took(item)
        finally:
            await items.aclose()
            settle(first)
        return Response(first, media_type="application/json", headers=gen.headers())

    async def body() -> AsyncIterator[bytes]:
        last = first
        try:
            yield first
            async for item in items:
                if isinstance(item, RelayUsage):
                    gen.took(item)
                else:
                    last = item
                    yield item
        except GatewayError as e:
            yield view.failed(e if isinstance(e, EngineError) else EngineError(e.message, code=e.code))
        finally:
            await items.aclose()
            settle(last)

    headers = dict(sse.SSE_HEADERS) if media_type == "text/event-stream" else {}
    return SSEResponse(body(), gen, None, error_response, primed=True, media_type=media_type, headers=headers)


def _deltas(data: bytes, call: RelayCall) -> list[tuple[dict[str, Any], str | None, str | int | None]]:
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


async def _translated(
    request: Request, gen: Generation, call: RelayCall, view: DeltaView, first: bytes,
    items: AsyncGenerator[Relayed, None], stream: bool, media_type: str,
) -> Response:
    """The node's chat (or completions) chunks, rendered by `view`."""

    async def rendered() -> AsyncIterator[bytes]:
        pending = [first]
        while True:
            for data in pending:
                for d, reason, stop in _deltas(data, call):
                    out = view.feed(d, reason, stop)
                    if out:
                        yield out
            item = await anext(items, None)
            if item is None:
                return
            if isinstance(item, RelayUsage):
                gen.took(item)
                pending = []
            else:
                pending = [item]

    if not stream:
        raw: list[bytes] = [first]

        async def drain() -> None:
            if not call.stream:  # a whole answer (count_tokens' /tokenize)
                raw.extend([i async for i in items if isinstance(i, bytes)])
                return
            async for _ in rendered():
                pass

        try:
            await until_disconnect(request, drain())
            from_raw = getattr(view, "from_raw", None)
            answer = view.whole() if call.stream or from_raw is None else from_raw(b"".join(raw))
        finally:
            await items.aclose()
            gen.finish()
        return Response(orjson.dumps(answer), media_type="application/json", headers=gen.headers())

    async def body() -> AsyncIterator[bytes]:
        try:
            yield view.head()
            async for part in rendered():
                yield part
            yield view.tail()
        except GatewayError as e:
            yield view.failed(e)
        finally:
            await items.aclose()
            gen.finish()

    headers = dict(sse.SSE_HEADERS) if media_type == "text/event-stream" else {}
    return SSEResponse(body(), gen, None, error_response, primed=True, media_type=media_type, headers=headers)
