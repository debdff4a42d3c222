"""The `remote` backend: an Engine that forwards generation to upstream
OpenAI-compatible servers (vLLM, MindIE, other npu-gateway nodes).

An `Upstream` is one named model served at one or more URLs. It owns one
aiohttp `ClientSession` (a pooled `TCPConnector`; PERF-NOTES.md says why not
httpx) shared by every request to it, so a dead or black-holed upstream only
ever holds its own connections. Per URL it keeps:

- the requests in flight there: least-outstanding balancing;
- a circuit breaker fed by requests (passive): `eject_after` failures in a
  row open it; after `cooldown` one trial request goes through (half-open);
  the trial's success closes it, its failure opens it again;
- a health flag fed by `GET /health` and `GET /v1/models` every
  `health_interval` (active); `eject_after` failed checks in a row eject the
  URL, one good check brings it back.

The gateway tokenizes (a local tokenizer folder; `simulated` for the byte
tokenizer of simulated upstreams; by default the embedded model's) and sends
the token ids as the `prompt` of a streamed `/v1/completions` request. Deltas
carry text; their `token_ids` are placeholders (`UNKNOWN_TOKEN`) whose number
is right: one per delta with text (or the logprobs' token count), and the last
delta carries the difference to the upstream's `usage.completion_tokens`.

Errors before the first token (unreachable, timeout, 5xx, every URL ejected)
are `ServiceUnavailable`, so a router can fall back; upstream 429 is
`QueueFull`; other 4xx are `InvalidRequest`. After the first token a failure
is an `EngineError`. `EngineDead` is never raised: the WorkerPool would
restart this stateless engine in a loop; the breaker tracks upstream health.
Cancelling `generate` (client disconnect) closes the upstream connection.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator, Callable, Collection, Iterable, Iterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

import aiohttp
import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine_adapter.errors import (
    EngineError,
    GatewayError,
    InvalidRequest,
    QueueFull,
    RequestTooLarge,
    ServiceUnavailable,
)
from engine_adapter.pool import WorkerPool
from engine_adapter.types import (
    EmbeddingRequest,
    EngineOutput,
    EngineStats,
    FinishReason,
    GenerationRequest,
    ModelCard,
    TokenLogprob,
    Tokenizer,
)

logger = logging.getLogger(__name__)

UNKNOWN_TOKEN = -1  # placeholder token id: the upstream sends text, not ids
_TIMEOUTS = (TimeoutError, asyncio.TimeoutError)
_REASONS: frozenset[str] = frozenset(("stop", "length", "abort", "error", "tool_calls"))
BreakerState = Literal["closed", "open", "half_open"]


@dataclass(frozen=True, slots=True)
class UpstreamConfig:
    name: str  # the served name here
    urls: tuple[str, ...]
    model: str | None = None  # the model id sent upstream; default: name
    tokenizer: str | None = None  # folder, "simulated", or None: embedded model
    connect_timeout: float = 2.0
    read_timeout: float = 30.0  # longest silence: to the headers, between chunks
    health_interval: float = 5.0
    eject_after: int = 3
    cooldown: float = 10.0
    max_model_len: int | None = None  # default: the upstream's /v1/models
    api_key_env: str | None = None  # environment variable holding the upstream key

    @property
    def remote_model(self) -> str:
        return self.model or self.name


_NUMBERS: dict[str, Callable[[str], float | int]] = {
    "connect_timeout": float, "read_timeout": float, "health_interval": float,
    "cooldown": float, "eject_after": int, "max_model_len": int,
}
_TEXTS = ("model", "tokenizer", "api_key_env")


def parse_upstream(spec: str, **defaults: Any) -> UpstreamConfig:
    """`NAME=URL[,URL...][;option=value...]`; options name UpstreamConfig fields."""
    head, *opts = (p.strip() for p in spec.split(";"))
    name, sep, urls = head.partition("=")
    name = name.strip()
    found = [u.strip().rstrip("/") for u in urls.split(",") if u.strip()]
    if not sep or not name or not found:
        raise ValueError(f"upstream {spec!r}: expected NAME=URL[,URL...][;option=value...]")
    for u in found:
        if not u.startswith(("http://", "https://")):
            raise ValueError(f"upstream {name!r}: {u!r} is not an http(s) URL")
    kw = {k: v for k, v in defaults.items() if v is not None}
    for opt in filter(None, opts):
        key, sep, value = (s.strip() for s in opt.partition("="))
        key = key.replace("-", "_")
        if not sep or key not in (*_NUMBERS, *_TEXTS):
            raise ValueError(f"upstream {name!r}: unknown option {opt!r}")
        kw[key] = _NUMBERS[key](value) if key in _NUMBERS else value
    cfg = UpstreamConfig(name=name, urls=tuple(u.removesuffix("/v1") for u in found), **kw)
    if cfg.eject_after < 1 or min(cfg.connect_timeout, cfg.read_timeout, cfg.health_interval, cfg.cooldown) <= 0:
        raise ValueError(f"upstream {name!r}: timeouts, intervals and eject_after must be positive")
    return cfg


@dataclass(slots=True)
class Endpoint:
    url: str
    outstanding: int = 0
    state: BreakerState = "closed"
    failures: int = 0  # request failures in a row
    opened_at: float = 0.0
    trial: bool = False  # a half-open trial request is in flight
    healthy: bool = True  # the active health checks' verdict
    check_failures: int = 0
    ejections: int = 0
    last_error: str | None = None

    def state_at(self, now: float, cooldown: float) -> BreakerState:
        if self.state == "open" and now - self.opened_at >= cooldown:
            return "half_open"
        return self.state

    def usable(self, now: float, cooldown: float) -> bool:
        state = self.state_at(now, cooldown)
        return self.healthy and (state == "closed" or (state == "half_open" and not self.trial))


class _CheckFailed(Exception):
    pass


class Upstream:
    """The URLs, breakers, health checks and HTTP session of one upstream."""

    def __init__(self, cfg: UpstreamConfig, tokenizer: Tokenizer) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.endpoints = [Endpoint(u) for u in cfg.urls]
        self.max_model_len = cfg.max_model_len or 4096
        self._session: aiohttp.ClientSession | None = None
        self._users = 0
        self._health: asyncio.Task[None] | None = None
        self._next = 0
        key = os.environ.get(cfg.api_key_env) if cfg.api_key_env else None
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def acquire(self) -> None:
        self._users += 1
        if self._session is None:
            c = self.cfg
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=30.0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=c.connect_timeout, sock_read=c.read_timeout),
                headers=self._headers,
            )
            self._health = asyncio.ensure_future(self._health_loop())

    async def release(self) -> None:
        self._users -= 1
        if self._users > 0 or self._session is None:
            return
        if self._health is not None:
            self._health.cancel()
            await asyncio.gather(self._health, return_exceptions=True)
        session, self._session = self._session, None
        await session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise ServiceUnavailable(f"upstream {self.cfg.name!r} is not started", retry_after=1)
        return self._session

    def pick(self, exclude: Collection[Endpoint] = ()) -> Endpoint:
        """The usable URL with the fewest requests in flight (round robin on ties)."""
        now, n, cd = time.monotonic(), len(self.endpoints), self.cfg.cooldown
        self._next = (self._next + 1) % n
        best: Endpoint | None = None
        for k in range(n):
            ep = self.endpoints[(self._next + k) % n]
            if ep not in exclude and ep.usable(now, cd) and (best is None or ep.outstanding < best.outstanding):
                best = ep
        if best is None:
            raise ServiceUnavailable(
                f"upstream {self.cfg.name!r}: every URL is ejected (failing requests or health checks)",
                code="upstream_ejected", retry_after=cd,
            )
        if best.state_at(now, cd) == "half_open":
            best.state, best.trial = "half_open", True
        return best

    def succeeded(self, ep: Endpoint) -> None:
        ep.failures = 0
        if ep.state != "closed":
            logger.info("upstream %s %s: breaker closed", self.cfg.name, ep.url)
            ep.state = "closed"

    def failed(self, ep: Endpoint, why: str) -> None:
        ep.failures += 1
        ep.last_error = why
        if ep.state == "half_open" or (ep.state == "closed" and ep.failures >= self.cfg.eject_after):
            ep.state, ep.opened_at = "open", time.monotonic()
            ep.ejections += 1
            logger.warning(
                "upstream %s %s: breaker open for %.0fs after %d failures (%s)",
                self.cfg.name, ep.url, self.cfg.cooldown, ep.failures, why,
            )

    async def _health_loop(self) -> None:
        while True:
            await asyncio.gather(*(self._check(ep) for ep in self.endpoints))
            await asyncio.sleep(self.cfg.health_interval)

    async def _check(self, ep: Endpoint) -> None:
        timeout = aiohttp.ClientTimeout(total=min(self.cfg.health_interval, self.cfg.read_timeout))
        try:
            async with self.session.get(ep.url + "/health", timeout=timeout) as r:
                if r.status != 200:
                    raise _CheckFailed(f"/health answered {r.status}")
            async with self.session.get(ep.url + "/v1/models", timeout=timeout) as r:
                if r.status != 200:
                    raise _CheckFailed(f"/v1/models answered {r.status}")
                data = orjson.loads(await r.read())
            card = next((m for m in data.get("data", ()) if m.get("id") == self.cfg.remote_model), None)
            if card is None:
                raise _CheckFailed(f"does not serve {self.cfg.remote_model!r}")
            if self.cfg.max_model_len is None and isinstance(card.get("max_model_len"), int):
                self.max_model_len = card["max_model_len"]
        except (aiohttp.ClientError, *_TIMEOUTS, ValueError, AttributeError, _CheckFailed, GatewayError) as e:
            ep.check_failures += 1
            if ep.healthy and ep.check_failures >= self.cfg.eject_after:
                ep.healthy = False
                ep.ejections += 1
                logger.warning("upstream %s %s: ejected by health checks: %s", self.cfg.name, ep.url, e or type(e).__name__)
            return
        ep.check_failures = 0
        if not ep.healthy:
            ep.healthy = True
            logger.info("upstream %s %s: health checks pass again", self.cfg.name, ep.url)


def completion_body(req: GenerationRequest, model: str) -> dict[str, Any]:
    s = req.sampling
    body: dict[str, Any] = {
        "model": model, "prompt": list(req.prompt_token_ids), "max_tokens": s.max_tokens, "n": s.n,
        "temperature": s.temperature, "top_p": s.top_p, "stream": True, "stream_options": {"include_usage": True},
    }
    optional: dict[str, Any] = {
        "top_k": s.top_k or None, "min_p": s.min_p or None, "seed": s.seed, "stop": list(s.stop) or None,
        "stop_token_ids": list(s.stop_token_ids) or None, "presence_penalty": s.presence_penalty or None,
        "frequency_penalty": s.frequency_penalty or None,
        "repetition_penalty": s.repetition_penalty if s.repetition_penalty != 1.0 else None,
        "logit_bias": {str(t): b for t, b in s.logit_bias} or None, "logprobs": s.logprobs,
        "ignore_eos": s.ignore_eos or None, "min_tokens": s.min_tokens or None,
        "skip_special_tokens": None if s.skip_special_tokens else False,
        "include_stop_str_in_output": s.include_stop_str_in_output or None, "priority": req.priority or None,
    }
    so = s.structured
    if so is not None:
        if so.json_schema is not None:
            optional["response_format"] = {"type": "json_schema", "json_schema": {"name": "schema", "schema": so.json_schema}}
        elif so.json_object:
            optional["response_format"] = {"type": "json_object"}
        extra = {"regex": so.regex, "choice": list(so.choice) if so.choice else None, "grammar": so.grammar}
        for key, value in extra.items():
            if value is not None:  # vLLM >= 0.10 reads structured_outputs; older ones and npu-gateway guided_*
                optional.setdefault("structured_outputs", {})[key] = value
                optional[f"guided_{key}"] = value
    body.update((k, v) for k, v in optional.items() if v is not None)
    return body


def _error_message(body: bytes) -> tuple[str, str | None]:
    try:
        err = orjson.loads(body).get("error")
        return str(err.get("message")), err.get("type")
    except (ValueError, AttributeError):
        return body[:200].decode("utf-8", "replace") or "no body", None


def _status_error(status: int, body: bytes, where: str) -> GatewayError:
    msg = f"upstream {where} answered {status}: {_error_message(body)[0]}"
    if status == 429:
        return QueueFull(msg, retry_after=1)
    if status == 413:
        return RequestTooLarge(msg)
    if 400 <= status < 500 and status not in (401, 403, 404, 408):
        return InvalidRequest(msg, code="upstream_rejected")
    return ServiceUnavailable(msg, code="upstream_error", retry_after=1)


def _logprobs(raw: Any) -> list[TokenLogprob | None] | None:
    if not isinstance(raw, dict) or not raw.get("tokens"):
        return None
    tops = raw.get("top_logprobs") or [None] * len(raw["tokens"])
    return [
        TokenLogprob(UNKNOWN_TOKEN, str(tok), float(lp if lp is not None else float("-inf")),
                     tuple((UNKNOWN_TOKEN, str(t), float(v)) for t, v in (top or {}).items()))
        for tok, lp, top in zip(raw["tokens"], raw.get("token_logprobs") or [], tops, strict=False)
    ]


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
                    resp = await self._open(ep, payload, headers)
                except ServiceUnavailable as e:  # nothing sent yet: one other URL may serve it
                    if len(tried) < min(2, len(up.endpoints)) and (req.deadline or 1e18) > time.monotonic():
                        last = e
                        continue
                    raise
                self._responses[req.request_id] = resp
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

    async def _open(self, ep: Endpoint, payload: bytes, headers: dict[str, str]) -> aiohttp.ClientResponse:
        up, where = self.upstream, f"{self.upstream.cfg.name!r} ({ep.url})"
        try:
            resp = await up.session.post(ep.url + "/v1/completions", data=payload, headers=headers)
        except _TIMEOUTS:
            up.failed(ep, "timeout")
            raise ServiceUnavailable(
                f"upstream {where} did not answer within {up.cfg.read_timeout:g}s", code="upstream_timeout", retry_after=1
            ) from None
        except aiohttp.ClientError as e:
            up.failed(ep, type(e).__name__)
            raise ServiceUnavailable(f"upstream {where} is unreachable: {e}", code="upstream_unreachable", retry_after=1) from None
        if resp.status == 200:
            return resp
        try:
            body = await resp.read()
        except (aiohttp.ClientError, *_TIMEOUTS):
            body = b""
        finally:
            resp.release()
        if resp.status >= 500 or resp.status in (401, 403, 404, 408):
            up.failed(ep, f"HTTP {resp.status}")
        raise _status_error(resp.status, body, where)

    async def _read(
        self, ep: Endpoint, resp: aiohttp.ClientResponse, req: GenerationRequest
    ) -> AsyncIterator[EngineOutput]:
        """Parse the SSE stream. Finished choices are held back until the
        usage event, so the last delta can carry the exact token count."""
        up, where = self.upstream, f"{self.upstream.cfg.name!r} ({ep.url})"
        plen, rid = len(req.prompt_token_ids), req.request_id
        pending: list[EngineOutput] = []
        counted, sent, done = 0, False, False
        usage: dict[str, Any] | None = None
        buf = b""
        try:
            async for chunk in resp.content.iter_any():
                buf += chunk
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, ": keep-alive" comments
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        done = True
                        break
                    event = orjson.loads(data)
                    if event.get("error"):
                        raise _event_error(event, where, sent)
                    for c in event.get("choices") or ():
                        text = c.get("text") or ""
                        lps = _logprobs(c.get("logprobs"))
                        ntok = len(lps) if lps is not None else (1 if text else 0)
                        counted += ntok
                        reason = c.get("finish_reason")
                        out = EngineOutput(
                            request_id=rid, index=int(c.get("index", 0)), text=text,
                            token_ids=(UNKNOWN_TOKEN,) * ntok, logprobs=lps, prompt_tokens=plen,
                            finish_reason=_finish(reason), stop_reason=c.get("stop_reason"),
                        )
                        if out.finish_reason is not None:
                            pending.append(out)
                        elif text or lps:
                            sent = True
                            yield out
                    usage = event.get("usage") or usage
                if done:
                    break
        except _TIMEOUTS:
            up.failed(ep, "read timeout")
            err = f"upstream {where} sent nothing for {up.cfg.read_timeout:g}s"
            raise (EngineError(err, code="upstream_timeout") if sent else ServiceUnavailable(err, code="upstream_timeout", retry_after=1)) from None
        except aiohttp.ClientError as e:
            up.failed(ep, type(e).__name__)
            err = f"upstream {where} closed the stream mid-response ({type(e).__name__})"
            raise (EngineError(err, code="upstream_disconnected") if sent else ServiceUnavailable(err, retry_after=1)) from None
        except ValueError:
            up.failed(ep, "malformed event")
            raise EngineError(f"upstream {where} sent a malformed event", code="upstream_error") from None
        if len({o.index for o in pending}) < req.sampling.n:
            up.failed(ep, "stream cut short")
            err = f"upstream {where} ended the stream before every choice finished"
            raise EngineError(err, code="upstream_disconnected") if sent else ServiceUnavailable(err, retry_after=1)
        resp.release()
        up.succeeded(ep)
        if usage is not None:
            last = pending[-1]
            missing = int(usage.get("completion_tokens") or 0) - counted
            if missing > 0:
                last.token_ids = (*last.token_ids, *(UNKNOWN_TOKEN,) * missing)
            details = usage.get("prompt_tokens_details") or {}
            last.cached_tokens = int(details.get("cached_tokens") or 0)
        for out in pending:
            yield out


def _finish(reason: Any) -> FinishReason | None:
    if reason is None:
        return None
    return reason if reason in _REASONS else "stop"  # type: ignore[no-any-return]


def _event_error(event: dict[str, Any], where: str, sent: bool) -> GatewayError:
    err = event.get("error") or {}
    msg = f"upstream {where}: {err.get('message') if isinstance(err, dict) else err}"
    kind = err.get("type") if isinstance(err, dict) else None
    if sent:
        return EngineError(msg, code="upstream_error")
    if kind == "rate_limit_error":
        return QueueFull(msg, retry_after=1)
    if kind == "invalid_request_error":
        return InvalidRequest(msg, code="upstream_rejected")
    return ServiceUnavailable(msg, code="upstream_error", retry_after=1)


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


def upstreams_of(pools: Iterable[WorkerPool]) -> list[Upstream]:
    found: dict[int, Upstream] = {}
    for p in pools:
        for w in p.workers:
            if isinstance(w.engine, RemoteEngine):
                found.setdefault(id(w.engine.upstream), w.engine.upstream)
    return list(found.values())


class UpstreamCollector(Collector):
    """Upstream health per URL, read at scrape time."""

    def __init__(self, pools: Callable[[], Iterable[WorkerPool]]) -> None:
        self._pools = pools

    def collect(self) -> Iterator[Metric]:
        labels = ["upstream", "url"]
        up = GaugeMetricFamily("npugw_upstream_up", "1: requests go to this upstream URL; 0: it is ejected.", labels=labels)
        state = GaugeMetricFamily(
            "npugw_upstream_breaker_state", "Circuit breaker state per upstream URL (1 for the current one).",
            labels=[*labels, "state"],
        )
        inflight = GaugeMetricFamily("npugw_upstream_outstanding_requests", "Requests in flight per upstream URL.", labels=labels)
        ejections = CounterMetricFamily("npugw_upstream_ejections", "Times an upstream URL was ejected.", labels=labels)
        now = time.monotonic()
        for u in upstreams_of(self._pools()):
            for ep in u.endpoints:
                key = [u.cfg.name, ep.url]
                current = ep.state_at(now, u.cfg.cooldown)
                up.add_metric(key, 1.0 if ep.healthy and current == "closed" else 0.0)
                for s in ("closed", "open", "half_open"):
                    state.add_metric([*key, s], 1.0 if s == current else 0.0)
                inflight.add_metric(key, ep.outstanding)
                ejections.add_metric(key, ep.ejections)
        yield from (up, state, inflight, ejections)
