"""The `remote` backend: an Engine that forwards generation to upstream
OpenAI-compatible servers (vLLM, MindIE, other npu-gateway nodes) over the
pooled aiohttp session of an `Upstream` (engine_adapter/routing/upstream.py:
URL balancing, circuit breakers, health checks).

The gateway tokenizes (a local tokenizer folder; `simulated` for the byte
tokenizer of simulated upstreams; by default the embedded model's) and sends
the token ids as the `prompt` of a streamed `/v1/completions` request with
`stream_options.include_usage`. Deltas carry text; their `token_ids` are
placeholders (`UNKNOWN_TOKEN`) whose number is right: one per delta with text
(or the logprobs' token count), and the last delta carries the difference to
the upstream's `usage.completion_tokens`.

Errors before the first token (unreachable, timeout, 5xx, every URL ejected)
are `ServiceUnavailable`, so a router can fall back; upstream 429 is
`QueueFull`; other 4xx are `InvalidRequest`. After the first token a failure
is an `EngineError`. `EngineDead` is never raised: the WorkerPool would
restart this stateless engine in a loop; the breakers track upstream health.
Cancelling `generate` (client disconnect) closes the upstream connection, so
the upstream sees the disconnect and aborts too.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, cast

import aiohttp
import orjson

from engine_adapter.errors import (
    EngineError,
    GatewayError,
    InvalidRequest,
    QueueFull,
    RequestTooLarge,
    ServiceUnavailable,
)
from engine_adapter.pool import WorkerPool
from engine_adapter.routing.upstream import TIMEOUTS, Endpoint, Upstream, UpstreamConfig
from engine_adapter.types import (
    EmbeddingRequest,
    EngineOutput,
    EngineStats,
    FinishReason,
    GenerationRequest,
    ModelCard,
    Tokenizer,
    TokenLogprob,
)

UNKNOWN_TOKEN = -1  # placeholder token id: the upstream sends text, not ids
_REASONS: frozenset[str] = frozenset(("stop", "length", "abort", "error", "tool_calls"))


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
            schema = {"name": "schema", "schema": so.json_schema}
            optional["response_format"] = {"type": "json_schema", "json_schema": schema}
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


def _logprobs(raw: Any) -> list[TokenLogprob] | None:
    """Completions-shaped logprobs (token strings; ids are unknown)."""
    if not isinstance(raw, dict) or not raw.get("tokens"):
        return None
    n = len(raw["tokens"])
    lps = raw.get("token_logprobs") or [None] * n
    tops = raw.get("top_logprobs") or [None] * n
    return [
        TokenLogprob(
            UNKNOWN_TOKEN, str(tok), float("-inf") if lp is None else float(lp),
            tuple((UNKNOWN_TOKEN, str(t), float(v)) for t, v in (top or {}).items()),
        )
        for tok, lp, top in zip(raw["tokens"], lps, tops, strict=False)
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
        except TIMEOUTS:
            up.failed(ep, "timeout")
            msg = f"upstream {where} did not answer within {up.cfg.read_timeout:g}s"
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
        raise _status_error(resp.status, body, where)

    async def _read(
        self, ep: Endpoint, resp: aiohttp.ClientResponse, req: GenerationRequest
    ) -> AsyncGenerator[EngineOutput, None]:
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
        except TIMEOUTS:
            up.failed(ep, "read timeout")
            err = f"upstream {where} sent nothing for {up.cfg.read_timeout:g}s"
            raise _broken(err, sent, "upstream_timeout") from None
        except aiohttp.ClientError as e:
            up.failed(ep, type(e).__name__)
            err = f"upstream {where} closed the stream mid-response ({type(e).__name__})"
            raise _broken(err, sent, "upstream_disconnected") from None
        except ValueError:
            up.failed(ep, "malformed event")
            raise EngineError(f"upstream {where} sent a malformed event", code="upstream_error") from None
        if len({o.index for o in pending}) < req.sampling.n:
            up.failed(ep, "stream cut short")
            err = f"upstream {where} ended the stream before every choice finished"
            raise _broken(err, sent, "upstream_disconnected")
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
    return cast(FinishReason, reason) if reason in _REASONS else "stop"


def _broken(msg: str, sent: bool, code: str) -> GatewayError:
    """A stream that broke: retryable before the first token, not after."""
    if sent:
        return EngineError(msg, code=code)
    return ServiceUnavailable(msg, code=code, retry_after=1)


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





def is_remote(pool: WorkerPool) -> bool:
    """Whether the pool's engines are upstreams (for /ready: a dead upstream
    must not take the whole gateway out of its load balancer)."""
    return any(isinstance(w.engine, RemoteEngine) for w in pool.workers)
