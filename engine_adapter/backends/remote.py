"""The `remote` backend: upstream nodes (vLLM / vllm-ascend, MindIE, other
npu-gateways) behind one served name, reached by pass-through over the
pooled aiohttp session of an `Upstream` (engine_adapter/routing/upstream.py:
URL balancing, circuit breakers, health checks, the node's model id).

A request goes upstream as the same endpoint with the same JSON body. The
gateway changes only what it owns: `model` (the node's own id), the request
id header, and `stream_options.include_usage` on generation streams (it needs
the usage for accounting; the usage chunk reaches the client only if it
asked). The answer comes back as the node sent it: streams are relayed one
network read at a time, with `model` rewritten to the name the client used
as a byte-level replace; no token is parsed or re-encoded. No local
tokenizer or chat template is involved.

Bounded failures: a streamed call's `read_timeout` covers the wait for the
headers and every gap between reads. A non-streamed call (a client that does
not stream, embeddings, tokenize) is sent as is: its answer is its first
byte, so it has no read timeout of its own; instead the URL it waits on must
show life (health checks, other answers, a `/health` ping at half of
`read_timeout`), and a URL silent for `read_timeout` is ejected, which fails
its waiters at once (engine_adapter/routing/upstream.py). `;plain=stream`
serves such clients from a streamed call joined back (`aggregate.py`)
instead: it also catches a node whose `/health` answers while its engine
hangs, at the price of a streamed call per request. Before the first byte
reached the client, a failing URL is retried once on another healthy URL; a
URL ejected by the health checks fails the requests waiting on it at once.
Upstream 4xx are relayed with their status and body (`UpstreamRejected`),
429 keeps its Retry-After. After the first byte, a failure ends the stream
with an error event. Cancelling (client disconnect) closes the upstream
connection, so the node aborts too.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

import aiohttp
import orjson

from engine_adapter.backends.aggregate import aggregate
from engine_adapter.backends.api_relay import relay_stream
from engine_adapter.backends.relay_bytes import Ejection, Rewrite, take_usage
from engine_adapter.errors import (
    EngineError,
    InvalidRequest,
    RateLimited,
    ServiceUnavailable,
    UpstreamRejected,
)
from engine_adapter.pool import WorkerPool
from engine_adapter.routing.policy import RouteKey
from engine_adapter.routing.upstream import TIMEOUTS, Endpoint, Upstream, UpstreamConfig
from engine_adapter.types import (
    EmbeddingRequest,
    EngineOutput,
    EngineStats,
    GenerationRequest,
    ModelCard,
    RelayCall,
    RelayUsage,
    Tokenizer,
)

__all__ = ["Opened", "RemoteEngine", "build_remote_pool", "is_remote"]

# Endpoints whose streams carry tokens (usage is asked for on streams).
GENERATION_PATHS = frozenset(("/v1/chat/completions", "/v1/completions"))


class RemoteEngine:
    """The Engine of a remote pool: one `Upstream`, shared by the pool's
    workers. It relays (`relay`), it does not generate."""

    relays = True  # readiness is the upstream's health, not a probe generation

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._open: dict[str, aiohttp.ClientResponse] = {}

    @property
    def card(self) -> ModelCard:
        return ModelCard(max_model_len=self.upstream.max_model_len, root=self.upstream.cfg.name)

    @property
    def tokenizer(self) -> Tokenizer:
        raise InvalidRequest(
            f"model {self.upstream.cfg.name!r} is served by upstream nodes; the gateway holds no tokenizer for it"
        )

    async def start(self) -> None:
        await self.upstream.acquire()

    async def stop(self) -> None:
        for resp in list(self._open.values()):
            resp.close()
        await self.upstream.release()

    async def health(self) -> None:
        now = time.monotonic()
        if not any(ep.usable(now, self.upstream.cfg.cooldown) for ep in self.upstream.endpoints):
            # short: the readiness probe logs it at each interval; the reason itself
            # is logged once by the health checks, and a refusal carries it
            raise ServiceUnavailable(f"upstream {self.upstream.cfg.name!r}: every URL is ejected", retry_after=1)

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._open), unfinished=len(self._open))

    async def abort(self, request_id: str) -> None:
        resp = self._open.pop(request_id, None)
        if resp is not None:
            resp.close()  # drop the connection: the node sees the disconnect

    async def embed(self, req: EmbeddingRequest) -> list[list[float]]:
        raise InvalidRequest("embeddings of a remote model are passed through, not computed here")

    async def generate(self, req: GenerationRequest) -> AsyncGenerator[EngineOutput, None]:
        raise InvalidRequest(f"model {self.upstream.cfg.name!r} is passed through to its nodes")
        yield  # pragma: no cover  (an async generator)

    # ---- pass-through ----------------------------------------------------
    async def open(self, call: RelayCall, session: str | None = None) -> Opened:
        """Send `call` to a node and wait for its status line: part of
        admission, so a node that refuses, is unreachable or is ejected
        meanwhile fails here and a router can move the request on (to
        another alias target, local or not). A failing URL is retried once
        on another healthy URL."""
        up = self.upstream
        generation = call.path in GENERATION_PATHS
        tried: list[Endpoint] = []
        last: ServiceUnavailable | None = None
        key = up.policy.key_for_body(call.body, session, call.node_model) if len(up.endpoints) > 1 else None
        while True:
            try:
                ep = up.pick(exclude=tried, key=key, model=call.node_model)
            except ServiceUnavailable:
                if last is not None:
                    raise last from None
                raise
            tried.append(ep)
            node_model = call.node_model or up.model_for(ep, call.path)  # an adapter's or discovered model's id
            body = dict(call.body)
            body["model"] = node_model
            joined = generation and not call.stream and up.cfg.plain == "stream"
            if generation and (call.stream or joined):
                body["stream"] = True
                opts = body.get("stream_options")
                body["stream_options"] = {**(opts if isinstance(opts, dict) else {}), "include_usage": True}
            ep.outstanding += 1
            opened = Opened(self, ep, call, node_model, key)
            try:
                opened.resp, opened.body = await self._open_on(
                    ep, call, orjson.dumps(body), plain=not (call.stream or joined)
                )
            except ServiceUnavailable as e:  # nothing sent: one other healthy URL may serve it
                opened.close()
                if len(tried) < min(2, len(up.endpoints)) and (call.deadline or 1e18) > time.monotonic():
                    last = e
                    continue
                raise
            except BaseException:
                opened.close()
                raise
            self._open[call.request_id] = opened.resp
            return opened

    async def _open_on(
        self, ep: Endpoint, call: RelayCall, payload: bytes, *, plain: bool
    ) -> tuple[aiohttp.ClientResponse, bytes | None]:
        """POST to `ep`; the response once its headers came (and, for a
        `plain` non-streamed call, its body), or an error kind. Gives up at
        once if `ep` is ejected meanwhile (health checks, or silence while
        plain calls wait on it)."""
        up, where = self.upstream, f"{self.upstream.cfg.name!r} ({ep.url})"
        headers = {"Content-Type": "application/json", "X-Request-Id": call.request_id, **dict(call.headers)}
        if plain:
            if not ep.waiting:
                ep.watch_from = time.monotonic()
            ep.waiting += 1
        # The POST runs in this task; an ejection of `ep` meanwhile cancels it
        # (one callback instead of a task and a wait per request).
        eject = Ejection(ep.ejected)
        try:
            resp, body = await self._post(ep, ep.url + call.path, payload, headers, plain)
        except asyncio.CancelledError:
            if not eject.hit or eject.task.uncancel() > 0:
                raise  # cancelled from outside (the client left)
            # aiohttp closed its connection on the cancel
            msg = f"upstream {where} was ejected while this request waited for it ({ep.last_error})"
            raise ServiceUnavailable(msg, code=ep.ejected.result(), retry_after=1) from None
        except TIMEOUTS:
            up.failed(ep, "timeout")
            msg = f"upstream {where} did not answer within {up.cfg.read_timeout:g}s"
            raise ServiceUnavailable(msg, code="upstream_timeout", retry_after=1) from None
        except aiohttp.ClientError as e:
            up.failed(ep, type(e).__name__)
            msg = f"upstream {where} is unreachable or closed the connection: {e}"
            raise ServiceUnavailable(msg, code="upstream_unreachable", retry_after=1) from None
        finally:
            eject.off()
            if plain:
                ep.waiting -= 1
        if resp.status == 200:
            return resp, body
        try:
            body = await resp.read()
        except (aiohttp.ClientError, *TIMEOUTS):
            body = b""
        finally:
            resp.release()
        msg = f"upstream {where} answered {resp.status}"
        if resp.status == 429:
            retry = resp.headers.get("Retry-After")
            raise RateLimited(f"{msg}: {_message(body)}", code="upstream_rate_limited",
                              retry_after=_seconds(retry), headers={})
        if 400 <= resp.status < 500 and resp.status not in (401, 403, 408):
            raise UpstreamRejected(f"{msg}: {_message(body)}", status=resp.status, body=body,
                                   content_type=resp.headers.get("Content-Type", "application/json"))
        up.failed(ep, f"HTTP {resp.status}")
        raise ServiceUnavailable(f"{msg}: {_message(body)}", code="upstream_error", retry_after=1)

    async def _post(
        self, ep: Endpoint, url: str, payload: bytes, headers: dict[str, str], plain: bool
    ) -> tuple[aiohttp.ClientResponse, bytes | None]:
        up = self.upstream
        if plain:  # no read timeout: the silence watch bounds it (see the module's doc)
            resp = await up.session.post(url, data=payload, headers=headers, timeout=up.plain_timeout)
            ep.last_seen = time.monotonic()
            if resp.status != 200:
                return resp, None
            body = await resp.read()
            ep.last_seen = time.monotonic()
            resp.release()
            return resp, body
        resp = await up.session.post(url, data=payload, headers=headers)
        ep.last_seen = time.monotonic()
        return resp, None

    async def _stream(
        self, ep: Endpoint, resp: aiohttp.ClientResponse, rewrite: Rewrite, *, want_usage: bool
    ) -> AsyncGenerator[bytes | RelayUsage, None]:
        """Relay the node's SSE stream one read at a time. An event cut by a
        read waits for its end (so `model` is rewritten whole and the usage
        event can be taken out); nothing else is parsed."""
        up, where = self.upstream, f"{self.upstream.cfg.name!r} ({ep.url})"
        buf = b""
        sent = done = False
        usage: RelayUsage | None = None
        try:
            async for chunk in resp.content.iter_any():
                ep.last_seen = time.monotonic()
                data = buf + chunk if buf else chunk
                cut = data.rfind(b"\n\n")
                if cut < 0:
                    buf = data
                    continue
                buf = data[cut + 2:]
                whole = data[: cut + 2]
                if b'"usage":{' in whole or b'"usage": {' in whole:
                    whole, usage = take_usage(whole, want_usage, usage)
                if b"data: [DONE]" in whole:
                    done = True
                if whole:
                    sent = True
                    yield rewrite(whole)
        except TIMEOUTS:
            up.failed(ep, "read timeout")
            raise _broken(f"upstream {where} sent nothing for {up.cfg.read_timeout:g}s", sent,
                          "upstream_timeout") from None
        except aiohttp.ClientError as e:
            up.failed(ep, type(e).__name__)
            raise _broken(f"upstream {where} closed the stream mid-response ({type(e).__name__})", sent,
                          "upstream_disconnected") from None
        if not done:
            up.failed(ep, "stream cut short")
            raise _broken(f"upstream {where} ended the stream without [DONE]", sent, "upstream_disconnected")
        resp.release()
        up.succeeded(ep)
        if usage is not None:
            yield usage

    async def _joined(
        self, ep: Endpoint, resp: aiohttp.ClientResponse, path: str, rewrite: Rewrite
    ) -> AsyncGenerator[bytes | RelayUsage, None]:
        """A streamed call joined into the non-streamed answer."""
        events: list[dict[str, Any]] = []
        async for item in self._stream(ep, resp, Rewrite("", ""), want_usage=True):
            if isinstance(item, RelayUsage):
                continue
            for line in item.split(b"\n"):
                if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                    try:
                        events.append(orjson.loads(line[5:]))
                    except ValueError:
                        raise EngineError(f"upstream {self.upstream.cfg.name!r} sent a malformed event",
                                          code="upstream_error") from None
        for event in events:
            if event.get("error"):
                err = event["error"]
                msg = err.get("message") if isinstance(err, dict) else err
                raise EngineError(f"upstream {self.upstream.cfg.name!r}: {msg}", code="upstream_error")
        answer = aggregate(path, events)
        yield rewrite(orjson.dumps(answer))
        usage = RelayUsage.from_dict(answer.get("usage"))
        if usage is not None:
            yield usage

    def _whole(self, ep: Endpoint, body: bytes, rewrite: Rewrite) -> list[bytes | RelayUsage]:
        """A non-streamed answer: the body as sent (`model` rewritten), then
        its usage if it has one."""
        self.upstream.succeeded(ep)
        items: list[bytes | RelayUsage] = [rewrite(body)]
        at = body.rfind(b'"usage"')
        if at >= 0:
            try:
                usage = RelayUsage.from_dict(orjson.loads(body).get("usage"))
            except (ValueError, AttributeError):
                usage = None
            if usage is not None:
                items.append(usage)
        return items


class Opened:
    """A request a node has accepted (its status line came): `items()`
    relays its answer, `close()` drops it (the node sees the disconnect)."""

    __slots__ = ("_done", "body", "call", "ep", "key", "node_model", "remote", "resp", "trial")

    def __init__(
        self, remote: RemoteEngine, ep: Endpoint, call: RelayCall, node_model: str, key: RouteKey | None = None
    ) -> None:
        self.remote = remote
        self.key = key  # the routing key it was routed by: settled with the policy when it ends
        self.ep = ep
        self.call = call
        self.node_model = node_model
        self.trial = ep.trial
        self.resp: aiohttp.ClientResponse | None = None
        self.body: bytes | None = None  # a non-streamed call's answer, read with its headers
        self._done = False

    async def items(self) -> AsyncGenerator[bytes | RelayUsage, None]:
        """The bytes to send to the client (one item per network read for a
        stream; the whole body otherwise), then the usage, if the node gave
        one. `model` reads as the served name the call carries."""
        call, remote, resp = self.call, self.remote, self.resp
        assert resp is not None
        rewrite = Rewrite(self.node_model, call.model)
        try:
            if self.body is not None:
                for item in remote._whole(self.ep, self.body, rewrite):
                    yield item
                return
            if call.stream and call.path not in GENERATION_PATHS:  # Responses, Messages, /generate: api_relay.py
                up, ep = remote.upstream, self.ep
                items = relay_stream(f"{up.cfg.name!r} ({ep.url})", resp, call.path, rewrite,
                                     lambda why: up.failed(ep, why), lambda: up.succeeded(ep), up.cfg.read_timeout)
            elif call.stream:
                items = remote._stream(self.ep, resp, rewrite, want_usage=call.want_usage)
            else:  # a non-streaming client of a generation endpoint
                items = remote._joined(self.ep, resp, call.path, rewrite)
            async with aclosing(items) as it:
                async for item in it:
                    yield item
        finally:
            self.close()

    def close(self) -> None:
        if self._done:
            return
        self._done = True
        self.ep.outstanding -= 1
        if self.trial:
            self.ep.trial = False
        self.remote._open.pop(self.call.request_id, None)
        if self.key is not None:
            up = self.remote.upstream
            if self.ep in up.endpoints:
                up.policy.settle_key(up.endpoints.index(self.ep), self.key)
        if self.resp is not None:
            self.resp.close()  # no-op once released; else the node sees a disconnect


def _broken(msg: str, sent: bool, code: str) -> EngineError | ServiceUnavailable:
    """A stream that broke: retryable before the first byte, not after."""
    if sent:
        return EngineError(msg, code=code)
    return ServiceUnavailable(msg, code=code, retry_after=1)


def _message(body: bytes) -> str:
    try:
        err = orjson.loads(body).get("error")
        return str(err.get("message") if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace") or "no body"


def _seconds(value: str | None) -> float:
    try:
        return max(1.0, float(value)) if value else 1.0
    except ValueError:
        return 1.0


def build_remote_pool(cfg: UpstreamConfig, **pool_kw: Any) -> WorkerPool:
    """A one-worker WorkerPool (queue, admission) whose engine is the
    upstream; `slots_per_worker` bounds the requests in flight to it."""
    up = Upstream(cfg)
    return WorkerPool(cfg.name, lambda i: RemoteEngine(up), num_workers=1, **pool_kw)


def is_remote(pool: object) -> bool:
    """Whether the pool's engines are upstream nodes."""
    return any(getattr(w.engine, "relays", False) for w in getattr(pool, "workers", ()))
