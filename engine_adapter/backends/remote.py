"""The `remote` backend: an Engine that forwards generation to upstream
OpenAI-compatible servers (vLLM, MindIE, other npu-gateway nodes) over the
pooled aiohttp session of an `Upstream` (engine_adapter/routing/upstream.py:
URL balancing, circuit breakers, health checks).

The gateway tokenizes (a local tokenizer folder; `simulated` for the byte
tokenizer of simulated upstreams; by default the embedded model's) and sends
the token ids as the `prompt` of a streamed `/v1/completions` request with
`stream_options.include_usage`. Deltas carry text; their `token_ids` are
placeholders (`UNKNOWN_TOKEN`) whose number is right: one per upstream event
with text (or the logprobs' token count), and the last delta carries the
difference to the upstream's `usage.completion_tokens`. The events of one
network read are parsed together and merged into one delta per choice (in the
order the choices first appear), yielded at the end of that read: a slow
stream still goes out token by token, a fast one costs one EngineOutput (and
one pool hand-off) per read instead of per token.

A request whose client does not stream (`GenerationRequest.stream` False) is
one non-streamed upstream call: one JSON body, one EngineOutput per choice
(token counts from `usage.completion_tokens`, split per choice by the
logprobs, `max_tokens` for choices cut by length, else by text length). The
upstream sends nothing before it has finished, so that call waits up to the
request deadline, not just `read_timeout`.

Errors before the first token (unreachable, timeout, 5xx, every URL ejected)
are `ServiceUnavailable`, so a router can fall back; upstream 429 is
`QueueFull`; other 4xx are `InvalidRequest`. After the first token a failure
is an `EngineError`. `EngineDead` is never raised: the WorkerPool would
restart this stateless engine in a loop; the breakers track upstream health.
Cancelling `generate` (client disconnect) closes the upstream connection, so
the upstream sees the disconnect and aborts too.

The request body, the error mapping and the parsing helpers (no I/O) are in
engine_adapter/backends/openai_wire.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any

import aiohttp
import orjson

from engine_adapter.backends.openai_wire import (
    UNKNOWN_TOKEN,
    Merged,
    broken,
    completion_body,
    event_error,
    finish_reason,
    parse_logprobs,
    status_error,
    whole_outputs,
)
from engine_adapter.errors import EngineError, InvalidRequest, ServiceUnavailable
from engine_adapter.pool import WorkerPool
from engine_adapter.routing.upstream import TIMEOUTS, Endpoint, Upstream, UpstreamConfig
from engine_adapter.types import (
    EmbeddingRequest,
    EngineOutput,
    EngineStats,
    GenerationRequest,
    ModelCard,
    Tokenizer,
)

__all__ = ["UNKNOWN_TOKEN", "RemoteEngine", "build_remote_pool", "completion_body", "is_remote", "load_tokenizer"]


class RemoteEngine:
    """One Engine over an `Upstream` (shared by the pool's workers)."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self._responses: dict[str, aiohttp.ClientResponse] = {}

    @property
    def card(self) -> ModelCard:
        return ModelCard(max_model_len=self.upstream.max_model_len, root=self.upstream.cfg.remote_model)

    @property
    def tokenizer(self) -> Tokenizer:
        return self.upstream.tokenizer

    async def start(self) -> None:
        await self.upstream.acquire()

    async def stop(self) -> None:
        for resp in self._responses.values():
            resp.close()
        await self.upstream.release()

    async def health(self) -> None:
        now = time.monotonic()
        if not any(ep.usable(now, self.upstream.cfg.cooldown) for ep in self.upstream.endpoints):
            raise ServiceUnavailable(f"upstream {self.upstream.cfg.name!r}: every URL is ejected", retry_after=1)

    def stats(self) -> EngineStats:
        return EngineStats(running=len(self._responses))

    async def abort(self, request_id: str) -> None:
        resp = self._responses.pop(request_id, None)
        if resp is not None:
            resp.close()  # drop the connection: the upstream sees the disconnect

    async def embed(self, req: EmbeddingRequest) -> list[list[float]]:
        raise InvalidRequest("embeddings are not served through remote upstreams")

    async def generate(self, req: GenerationRequest) -> AsyncIterator[EngineOutput]:
        up = self.upstream
        if req.sampling.prompt_logprobs is not None:
            raise InvalidRequest("prompt logprobs (echo with logprobs) are not supported for remote models")
        payload = orjson.dumps(completion_body(req, up.cfg.remote_model))
        headers = {"Content-Type": "application/json", "X-Request-Id": req.request_id}
        tried: list[Endpoint] = []
        last: ServiceUnavailable | None = None
        while True:
            try:
                ep = up.pick(exclude=tried)
            except ServiceUnavailable:
                if last is not None:
                    raise last from None
                raise
            tried.append(ep)
            ep.outstanding += 1
            trial = ep.trial
            resp: aiohttp.ClientResponse | None = None
            try:
                try:
                    resp = await self._open(ep, payload, headers, None if req.stream else self._whole_timeout(req))
                except ServiceUnavailable as e:  # nothing sent yet: one other URL may serve it
                    if len(tried) < min(2, len(up.endpoints)) and (req.deadline or 1e18) > time.monotonic():
                        last = e
                        continue
                    raise
                self._responses[req.request_id] = resp
                if not req.stream:
                    for out in await self._read_whole(ep, resp, req):
                        yield out
                    return
                async with aclosing(self._read(ep, resp, req)) as stream:
                    async for out in stream:
                        yield out
                return
            finally:
                ep.outstanding -= 1
                if trial:
                    ep.trial = False
                self._responses.pop(req.request_id, None)
                if resp is not None:
                    resp.close()  # no-op once released; else the upstream sees a disconnect

    def _whole_timeout(self, req: GenerationRequest) -> aiohttp.ClientTimeout:
        """A non-streamed call's timeouts: the upstream says nothing until it
        has generated everything, so `read_timeout` would cut long answers;
        the request deadline bounds the wait instead (none without one)."""
        c = self.upstream.cfg
        wait = None if req.deadline is None else max(c.read_timeout, req.deadline - time.monotonic())
        return aiohttp.ClientTimeout(total=None, sock_connect=c.connect_timeout, sock_read=wait)

    async def _open(
        self, ep: Endpoint, payload: bytes, headers: dict[str, str], timeout: aiohttp.ClientTimeout | None = None
    ) -> aiohttp.ClientResponse:
        up, where = self.upstream, f"{self.upstream.cfg.name!r} ({ep.url})"
        url = ep.url + "/v1/completions"
        try:
            if timeout is None:
                resp = await up.session.post(url, data=payload, headers=headers)
            else:
                resp = await up.session.post(url, data=payload, headers=headers, timeout=timeout)
        except TIMEOUTS:
            up.failed(ep, "timeout")
            waited = up.cfg.read_timeout if timeout is None else timeout.sock_read
            msg = f"upstream {where} did not answer within {waited or 0:g}s"
            raise ServiceUnavailable(msg, code="upstream_timeout", retry_after=1) from None
        except aiohttp.ClientError as e:
            up.failed(ep, type(e).__name__)
            msg = f"upstream {where} is unreachable: {e}"
            raise ServiceUnavailable(msg, code="upstream_unreachable", retry_after=1) from None
        if resp.status == 200:
            return resp
        try:
            body = await resp.read()
        except (aiohttp.ClientError, *TIMEOUTS):
            body = b""
        finally:
            resp.release()
        if resp.status >= 500 or resp.status in (401, 403, 404, 408):
            up.failed(ep, f"HTTP {resp.status}")
        raise status_error(resp.status, body, where)

    async def _read(
        self, ep: Endpoint, resp: aiohttp.ClientResponse, req: GenerationRequest
    ) -> AsyncGenerator[EngineOutput, None]:
        """Parse the SSE stream, one network read at a time: the deltas of a
        read are merged per choice and yielded at its end. Finished choices
        are held back until the stream ends, so the last delta can carry the
        exact token count from the usage event."""
        up, where = self.upstream, f"{self.upstream.cfg.name!r} ({ep.url})"
        plen, rid = len(req.prompt_token_ids), req.request_id
        pending: list[EngineOutput] = []
        acc: dict[int, EngineOutput] = {}  # this read's unfinished deltas, one per choice
        more: dict[int, Merged] | None = None  # the choices with several deltas in this read
        counted, sent, done = 0, False, False
        usage: dict[str, Any] | None = None
        buf = b""
        loads = orjson.loads
        try:
            async for chunk in resp.content.iter_any():
                if buf:
                    chunk = buf + chunk
                lines = chunk.split(b"\n")
                buf = lines.pop()
                if not lines:
                    continue  # no whole line yet
                acc, more = {}, None
                datas = []  # blank separators and ": keep-alive" comments drop out
                for line in lines:
                    if line[:5] == b"data:":
                        datas.append(line[5:])  # JSON allows the spaces around
                if not datas:
                    continue
                if datas[-1].strip() == b"[DONE]":
                    done = True
                    datas.pop()
                # one parse per read (an array of the events), not one per event
                events = (loads(datas[0]),) if len(datas) == 1 else loads(b"[" + b",".join(datas) + b"]")
                for event in events:
                    if event.get("error"):
                        raise event_error(event, where, sent)
                    for c in event.get("choices") or ():
                        text = c.get("text") or ""
                        raw = c.get("logprobs")
                        lps = parse_logprobs(raw) if raw else None
                        ntok = len(lps) if lps is not None else (1 if text else 0)
                        counted += ntok
                        index = int(c.get("index") or 0)
                        reason = c.get("finish_reason")
                        if reason is not None:
                            pending.append(EngineOutput(
                                request_id=rid, index=index, text=text, token_ids=(UNKNOWN_TOKEN,) * ntok,
                                logprobs=lps, prompt_tokens=plen, finish_reason=finish_reason(reason),
                                stop_reason=c.get("stop_reason"),
                            ))
                        elif text or lps:
                            out = acc.get(index)
                            if out is None:
                                # positional: half the cost of keywords (request_id, index, text,
                                # token_ids, logprobs, finish_reason, stop_reason, prompt_tokens)
                                ids = (UNKNOWN_TOKEN,) * ntok
                                acc[index] = EngineOutput(rid, index, text, ids, lps, None, None, plen)
                            else:  # merged at the end of the read
                                if more is None:
                                    more = {}
                                m = more.get(index)
                                if m is None:
                                    more[index] = m = Merged(out)
                                m.add(text, ntok, lps)
                    usage = event.get("usage") or usage
                if more:
                    for m in more.values():
                        m.apply()
                if done:
                    break  # this read's deltas go out with the finished choices
                if acc:
                    sent = True
                    for out in acc.values():
                        yield out
        except TIMEOUTS:
            up.failed(ep, "read timeout")
            err = f"upstream {where} sent nothing for {up.cfg.read_timeout:g}s"
            raise broken(err, sent, "upstream_timeout") from None
        except aiohttp.ClientError as e:
            up.failed(ep, type(e).__name__)
            err = f"upstream {where} closed the stream mid-response ({type(e).__name__})"
            raise broken(err, sent, "upstream_disconnected") from None
        except (ValueError, TypeError, AttributeError):
            up.failed(ep, "malformed event")
            raise EngineError(f"upstream {where} sent a malformed event", code="upstream_error") from None
        if len({o.index for o in pending}) < req.sampling.n:
            up.failed(ep, "stream cut short")
            err = f"upstream {where} ended the stream before every choice finished"
            raise broken(err, sent, "upstream_disconnected")
        resp.release()
        up.succeeded(ep)
        if done and acc:  # deltas of the last read: in front of their choice's finishing delta
            for fin in pending:
                out = acc.pop(fin.index, None)
                if out is not None:
                    m = Merged(out)
                    m.add(fin.text, len(fin.token_ids), fin.logprobs)
                    m.apply(fin)
        if usage is not None:
            last = pending[-1]
            missing = int(usage.get("completion_tokens") or 0) - counted
            if missing > 0:
                last.token_ids = (*last.token_ids, *(UNKNOWN_TOKEN,) * missing)
            details = usage.get("prompt_tokens_details") or {}
            last.cached_tokens = int(details.get("cached_tokens") or 0)
        if done:
            for out in acc.values():
                yield out
        for out in pending:
            yield out

    async def _read_whole(
        self, ep: Endpoint, resp: aiohttp.ClientResponse, req: GenerationRequest
    ) -> list[EngineOutput]:
        """A non-streamed answer: one EngineOutput per choice."""
        up, where = self.upstream, f"{self.upstream.cfg.name!r} ({ep.url})"
        try:
            body = await resp.read()
        except TIMEOUTS:
            up.failed(ep, "read timeout")
            err = f"upstream {where} did not finish sending its answer in time"
            raise broken(err, False, "upstream_timeout") from None
        except aiohttp.ClientError as e:
            up.failed(ep, type(e).__name__)
            err = f"upstream {where} closed the connection mid-response ({type(e).__name__})"
            raise broken(err, False, "upstream_disconnected") from None
        try:
            answer = orjson.loads(body)
            if answer.get("error"):
                raise event_error(answer, where, False)
            outs = whole_outputs(answer, req, self.upstream.tokenizer)
        except (ValueError, TypeError, AttributeError, KeyError):
            up.failed(ep, "malformed answer")
            raise EngineError(f"upstream {where} sent a malformed answer", code="upstream_error") from None
        if len({o.index for o in outs}) < req.sampling.n:
            up.failed(ep, "choices missing")
            err = f"upstream {where} answered {len(outs)} of {req.sampling.n} choices"
            raise broken(err, False, "upstream_error")
        resp.release()
        up.succeeded(ep)
        return outs


def load_tokenizer(spec: str | None) -> Tokenizer:
    """`simulated`: the byte tokenizer; a folder; None: the embedded model's."""
    if spec in ("simulated", "byte"):
        from engine_adapter.backends.simulated import ByteTokenizer

        return ByteTokenizer()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    from engine_adapter.backends.vllm import HfTokenizer
    from engine_adapter.model import prepare_embedded_model

    path = spec or str(prepare_embedded_model(progress=False))
    return HfTokenizer(AutoTokenizer.from_pretrained(path))


def build_remote_pool(cfg: UpstreamConfig, tokenizer: Tokenizer | None = None, **pool_kw: Any) -> WorkerPool:
    """A one-worker WorkerPool (queue, admission) whose engine is the upstream;
    `slots_per_worker` bounds the requests in flight to it."""
    up = Upstream(cfg, tokenizer if tokenizer is not None else load_tokenizer(cfg.tokenizer))
    return WorkerPool(cfg.name, lambda i: RemoteEngine(up), num_workers=1, **pool_kw)





def is_remote(pool: WorkerPool) -> bool:
    """Whether the pool's engines are upstreams (for /ready: a dead upstream
    must not take the whole gateway out of its load balancer)."""
    return any(isinstance(w.engine, RemoteEngine) for w in pool.workers)
