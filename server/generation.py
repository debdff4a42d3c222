"""The generation core, shared by every endpoint that generates text.

    gen = await admit(request, gw, principal, model, ask, session)
    if isinstance(gen, RelayGeneration):                   # upstream nodes
        return await relay_response(request, gen)          # (server/relay.py)
    return stream_response(gen, render, tail, keep_alive)   # or
    return await json_response(request, gen, build)

`admit` is the whole of admission, before any response byte: the key's
limits, then the model's `acquire` (alias and fallback choice, queue wait,
queue full). A refusal raises a `GatewayError` kind, which becomes a status
with `Retry-After`, streamed request or not. Only an admitted request gets a
response, whose body runs the lease. The lease's kind says which: a local
engine's (`Generation`, streamed here) or a call passed through to upstream
nodes (`RelayGeneration`, relayed by server/relay.py); a route dispatches
once, on that type. Endpoints only validate and render: `render` turns one
batch of engine deltas into bytes, `build` turns the collected choices into
the JSON answer.

Token charging is the same however a request ends (done, failed, client
gone): the prompt plus what was generated.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace
from typing import Any, Generic, TypeVar

import orjson
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine_adapter.errors import EngineError, GatewayError, InvalidRequest
from engine_adapter.lease import Lease, LocalLease, Prepared, RelayLease
from engine_adapter.types import EngineOutput, GenerationRequest, RelayCall, RelayUsage
from server.ask import RouteAsk, engine_trace, forwarded, ttft_deadline, with_deadline
from server.auth import Principal
from server.disconnect import until_disconnect, watched
from server.errors import error_event, error_response
from server.limits import Admission
from server.render import DONE, KEEP_ALIVE, SSE_HEADERS, Choice, Key, usage
from server.state import Gateway, ServedModel

logger = logging.getLogger(__name__)

SERVED_BY = "x-npugw-served-by"
L = TypeVar("L", LocalLease, RelayLease)


def session_of(request: Request, user: str | None) -> str | None:
    """The key that keeps a conversation on one target: `X-Session-ID`, else
    the request's `user`."""
    name: bytes
    value: bytes
    for name, value in request.scope["headers"]:  # ASGI names are lower case
        if name == b"x-session-id" and value:
            return value.decode("latin-1")[:256]
    return user or None


class Admitted(Generic[L]):
    """One admitted client request: the key's admission, the lease (of
    either kind), and the tokens it used."""

    __slots__ = ("_cached", "_done", "admission", "completion_tokens", "created", "lease", "model", "note",
                 "prompt_tokens")
    lease: L

    def __init__(self, model: ServedModel, lease: L, admission: Admission, note: dict[str, Any] | None = None) -> None:
        self.model = model
        # the request's scope["state"]: what the access log and the trace read
        self.note: dict[str, Any] = note if note is not None else {}
        self.lease = lease
        self.admission = admission
        self.created = int(time.time())
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self._cached: dict[int, int] = {}
        self._done = False

    @property
    def served_by(self) -> str:
        """The model that answers: the target an alias chose, else the name
        the client asked for."""
        return self.lease.served_by if self.model.routed else self.model.id

    @property
    def cached_tokens(self) -> int:
        return sum(self._cached.values())

    def headers(self) -> dict[str, str]:
        h = self.admission.headers()
        if self.model.routed:
            h = {**h, SERVED_BY: self.lease.served_by}
        return h

    def usage(self) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, self.cached_tokens)

    def finish(self) -> None:
        """Give back the lease and settle the key's tokens. Idempotent."""
        if self._done:
            return
        self._done = True
        self.lease.release()
        self.admission.finish(self.prompt_tokens, self.completion_tokens)
        self.note.update(
            t_done=time.perf_counter(), target=self.served_by, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, cached_tokens=self.cached_tokens, **self._noted(),
        )

    def _noted(self) -> dict[str, Any]:
        return {"relayed": False}


class RelayGeneration(Admitted[RelayLease]):
    """An admitted request passed through to upstream nodes: the node's
    answer is written by server/relay.py `RelayAnswer`; the usage it reports
    is taken with `took`."""

    __slots__ = ()

    @property
    def call(self) -> RelayCall:
        """The call that answers (an alias may move on before the first byte)."""
        return self.lease.call

    def took(self, usage: RelayUsage) -> None:
        """The usage a node reported for a passed-through request."""
        self.prompt_tokens = usage.prompt_tokens
        self.completion_tokens = usage.completion_tokens
        self._cached[0] = usage.cached_tokens

    def _noted(self) -> dict[str, Any]:
        return {"relayed": True, "upstream": self.lease.upstream}


class Generation(Admitted[LocalLease]):
    """An admitted request on local engines: their outputs, streamed or
    collected, with the tokens counted as they come."""

    __slots__ = ("_first", "_stream")

    def __init__(
        self, model: ServedModel, lease: LocalLease, admission: Admission, note: dict[str, Any] | None = None
    ) -> None:
        super().__init__(model, lease, admission, note)
        self.prompt_tokens = sum(len(r.prompt_token_ids) for r in lease.requests)
        self._stream: AsyncGenerator[tuple[int, list[EngineOutput]] | None, None] | None = None
        self._first: tuple[int, list[EngineOutput]] | None = None

    @property
    def requests(self) -> Sequence[GenerationRequest]:
        """The engine requests, one per prompt."""
        return self.lease.requests

    async def prime(self, idle_tick: float | None = None) -> None:
        """Wait for the first output, so that every failure before the first
        token (an alias falling back, an engine failing, a timeout) happens
        before a stream's status line: the status then says what happened
        and the `x-npugw-served-by` header names who answers."""
        self._stream = self._counted(idle_tick)
        try:
            while True:
                item = await self._stream.__anext__()
                if item is not None:
                    self._first = item
                    return
        except StopAsyncIteration:
            return

    async def outputs(
        self, idle_tick: float | None = None
    ) -> AsyncGenerator[tuple[int, list[EngineOutput]] | None, None]:
        """The engines' deltas, tagged with the prompt's index; None is an
        idle tick. Tokens are counted as they come. After `prime`, the first
        output, then the rest."""
        if self._stream is None:
            self._stream = self._counted(idle_tick)
        elif self._first is not None:
            first, self._first = self._first, None
            yield first
        # aclosing: leaving early (a disconnect) closes the engine stream now,
        # which aborts the engine request, instead of whenever it is collected
        async with aclosing(self._stream) as stream:
            async for item in stream:
                yield item

    async def _counted(
        self, idle_tick: float | None
    ) -> AsyncGenerator[tuple[int, list[EngineOutput]] | None, None]:
        cached = self._cached
        note = self.note
        async with aclosing(self.lease.stream(idle_tick)) as stream:
            async for p, batch in stream:
                if batch is None:
                    yield None
                    continue
                if "t_first" not in note:
                    note["t_first"] = time.perf_counter()
                for out in batch:
                    self.completion_tokens += len(out.token_ids)
                    if out.cached_tokens:
                        cached[p] = out.cached_tokens
                    if out.finish_reason is not None:
                        note.setdefault("finish_reasons", set()).add(out.finish_reason)
                        if out.timings is not None:  # the engine's own queue/prefill/decode times (the trace)
                            note["engine_timings"] = out.timings
                yield p, batch

    async def close(self) -> None:
        """Close the engine stream (aborting what still runs), then `finish`."""
        if self._stream is not None:
            await self._stream.aclose()
        self.finish()

    async def collect(self, each: Callable[[int, EngineOutput], None] | None = None) -> dict[Key, Choice]:
        """Every choice of every prompt, whole (for a non-streamed answer)."""
        n = self.requests[0].sampling.n
        choices: dict[Key, Choice] = {}
        async for item in self.outputs():
            assert item is not None
            p, batch = item
            for out in batch:
                key = (p, out.index)
                c = choices.get(key)
                if c is None:
                    c = choices[key] = Choice(p * n + out.index)
                c.add(out)
                if each is not None:
                    each(p, out)
        return dict(sorted(choices.items(), key=lambda kv: kv[1].index))


def note_outcome(note: dict[str, Any], outcome: str) -> None:
    """How a request ended when its engines' finish reasons do not say it:
    `cancelled` (the client left) or `error` (failed after its status
    line). The first one noted stays."""
    note.setdefault("outcome", outcome)


AnyGeneration = Generation | RelayGeneration  # what a renderer of both kinds takes


async def admit(
    request: Request,
    gw: Gateway,
    principal: Principal,
    model: ServedModel,
    ask: RouteAsk | Prepared,
    session: str | None,
) -> Generation | RelayGeneration:
    """Admission: the key's limits, then an engine slot per request (on the
    target an alias picks, in the form it takes: `ask`). Raises a
    `GatewayError` kind; returns only when the request will run: on local
    engines (a `Generation`) or passed through to upstream nodes (a
    `RelayGeneration`). A route's request is built first where local
    engines serve the model: a bad request is a 400 before any limit."""
    if isinstance(ask, RouteAsk) and not model.pool.relays:
        ask.local(model.pool, model.id)
    budget = ask.budget()
    ask = with_deadline(ask, ttft_deadline(request, principal))  # a bad header is a 400 here, before any limit
    note = request.scope.setdefault("state", {})
    note.update(key=principal.name, model=model.id, t_admit=time.perf_counter())
    admission = await gw.limits.admit(principal, model.id, budget)
    try:
        lease = await until_disconnect(request, model.pool.acquire(ask, session), discard=_release)
    except BaseException:
        admission.finish(0)
        raise
    note["t_admitted"] = time.perf_counter()
    if isinstance(lease, RelayLease):
        return RelayGeneration(model, lease, admission, note)
    return Generation(model, lease, admission, note)


async def admit_relay(
    request: Request, gw: Gateway, principal: Principal, model: ServedModel, ask: RouteAsk, session: str | None
) -> RelayGeneration:
    """`admit` for a request only upstream nodes take (its `ask` builds no
    local requests: a local target refuses it at admission)."""
    return _only(await admit(request, gw, principal, model, ask, session), RelayGeneration)


async def admit_local(
    request: Request, gw: Gateway, principal: Principal, model: ServedModel, ask: Prepared, session: str | None
) -> Generation:
    """`admit` for requests built before admission (local engines only:
    upstream nodes refuse a `Prepared` at admission)."""
    return _only(await admit(request, gw, principal, model, ask, session), Generation)


G = TypeVar("G", Generation, RelayGeneration)


def _only(gen: Generation | RelayGeneration, kind: type[G]) -> G:
    if isinstance(gen, kind):
        return gen
    gen.finish()
    raise InvalidRequest(f"model {gen.model.id!r} cannot take this request")


def prepared(request: Request, reqs: list[GenerationRequest]) -> Prepared:
    """Requests a route built itself (local engines only), with the
    request's trace context for an engine that traces itself."""
    trace = engine_trace(forwarded(request))
    return Prepared([replace(r, trace_headers=trace) for r in reqs] if trace else reqs)


def _release(lease: Lease) -> None:
    lease.release()


def openai_stream_error(err: GatewayError) -> bytes:
    """How an OpenAI stream ends on an error: an error event, then `[DONE]`."""
    return error_event(err) + DONE


def stream_response(
    gen: Generation,
    render: Callable[[int, list[EngineOutput]], bytes | None],
    tail: Callable[[], bytes],
    keep_alive: float | None,
    *,
    head: Callable[[], bytes] | None = None,
    on_error: Callable[[GatewayError], bytes] = openai_stream_error,
    ping: bytes = KEEP_ALIVE,
    refuse: Callable[[GatewayError], Response] = error_response,
) -> Response:
    """The SSE skeleton: `head()` first if given, rendered batches (one write
    each), `ping` when idle for `keep_alive` seconds, then `tail()` (which
    ends the stream: `[DONE]` for the OpenAI APIs). The status line waits for
    the first token (`Generation.prime`): a failure before it is a status and
    an error body (`refuse(err)`), never a stream. An error once the stream
    has begun ends it with `on_error(err)`. The lease and the key's tokens
    are settled however it ends."""

    async def body() -> AsyncIterator[bytes]:
        try:
            if head is not None:
                yield head()
            async with aclosing(gen.outputs(keep_alive)) as outputs:
                async for item in outputs:
                    if item is None:
                        yield ping
                        continue
                    chunk = render(*item)
                    if chunk:
                        yield chunk
            yield tail()
        except GatewayError as e:
            note_outcome(gen.note, "error")
            yield on_error(e)
        except Exception:
            logger.exception("stream failed")
            note_outcome(gen.note, "error")
            yield on_error(EngineError("internal error while streaming; see the gateway log"))
        finally:
            gen.finish()

    return SSEResponse(body(), gen, keep_alive, refuse, media_type="text/event-stream", headers=dict(SSE_HEADERS))


async def json_response(
    request: Request,
    gen: Generation,
    build: Callable[[dict[Key, Choice]], dict[str, Any]],
    each: Callable[[int, EngineOutput], None] | None = None,
) -> Response:
    """Collect the whole answer (aborting if the client goes away), then
    `build` its JSON."""
    try:
        choices = await until_disconnect(request, gen.collect(each))
        answer = build(choices)
    finally:
        gen.finish()
    return Response(orjson.dumps(answer), media_type="application/json", headers=gen.headers())


class SSEResponse(StreamingResponse):
    """A generation's SSE response. Before the status line it waits for the
    first token (`gen.prime()`, given up if the client leaves); a failure
    there is answered by `refuse(err)` instead, a status with an error body.
    The body runs in the request's task under the one disconnect watch
    (server/disconnect.py), not in an anyio task group (a measurable share
    of a short stream's CPU); as Starlette's, a disconnect cancels the body
    (so the engine request is aborted) and ends the response quietly. The
    generation is closed however it ends."""

    def __init__(
        self,
        body: AsyncIterator[bytes],
        gen: Generation,
        keep_alive: float | None,
        refuse: Callable[[GatewayError], Response],
        primed: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(body, **kwargs)
        self.gen = gen
        self.keep_alive = keep_alive
        self.refuse = refuse
        self.primed = primed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gen = self.gen
        watch, own = watched(scope, receive)
        try:
            if not self.primed:
                try:
                    await gen.prime(self.keep_alive)
                except GatewayError as e:
                    await gen.close()
                    await self.refuse(e)(scope, receive, send)
                    return
            for k, v in gen.headers().items():  # known now: the target that answers
                self.raw_headers.append((k.lower().encode("latin-1"), v.encode("latin-1")))
            await self.stream_response(send)
            if self.background is not None:
                await self.background()
        except asyncio.CancelledError:
            if not watch.left():
                raise
            note_outcome(gen.note, "cancelled")  # the client left: before the first token, or mid-stream
        finally:
            if own:
                watch.stop()
            # A disconnect can cancel the response while it awaits a socket
            # write, leaving the body suspended at a `yield`: close it now so
            # the engine request is aborted at once, not when it is collected.
            close = getattr(self.body_iterator, "aclose", None)
            if close is not None:
                await close()
            await gen.close()
