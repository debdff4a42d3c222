"""POST /v1/completions"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from engine_adapter.types import GenerationRequest
from server import sse
from server.deps import AuthDep, GatewayDep
from server.limits import Admission
from server.protocol import CompletionRequest
from server.render import Choice, CompletionLogprobs, finish, usage
from server.routes.docs import JSON_OR_SSE
from server.state import ServedModel
from server.streaming import guarded, merge, sse_response, until_disconnect
from server.validation import build_completion_request, completion_prompts, new_id

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])


@router.post("/v1/completions", response_model=None, responses=JSON_OR_SSE)
async def create_completion(
    body: CompletionRequest, request: Request, gw: GatewayDep, principal: AuthDep
) -> Response:
    if body.model_extra:
        logger.debug("ignoring unknown fields: %s", ", ".join(body.unknown_fields()))
    model = gw.resolve(body.model)
    principal.check_model(model.id)
    pool = model.pool
    rid = new_id("cmpl")
    prompts = completion_prompts(body, pool.tokenizer)
    priority = principal.priority_for(body.priority, "priority" in body.model_fields_set)
    reqs = [
        build_completion_request(
            body, text, ids, request_id=f"{rid}-{i}", model=model.id, card=pool.card,
            max_n=gw.settings.max_n, timeout=gw.settings.request_timeout, api_key_name=principal.name,
            priority=priority, vocab_hint=pool.tokenizer.vocab_size,
        )
        for i, (text, ids) in enumerate(prompts)
    ]
    budget = sum(len(r.prompt_token_ids) + r.sampling.max_tokens * r.sampling.n for r in reqs)
    admission = await gw.limits.admit(principal, model.id, budget)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(model, rid, reqs, body, created, include_usage, gw.settings.sse_keep_alive_interval, admission)
        return sse_response(guarded(events, admission.fail), admission.headers())
    try:
        result = await until_disconnect(request, _collect(model, rid, reqs, body, created))
    except BaseException:
        admission.finish(0)
        raise
    admission.finish(result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"])
    return Response(orjson.dumps(result), media_type="application/json", headers=admission.headers())


def _prompt_text(model: ServedModel, req: GenerationRequest) -> str:
    if req.prompt is not None:
        return req.prompt
    return model.pool.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=False)


async def _collect(
    model: ServedModel, rid: str, reqs: list[GenerationRequest], body: CompletionRequest, created: int
) -> dict[str, Any]:
    n = body.n
    choices = {(p, i): Choice(p * n + i) for p in range(len(reqs)) for i in range(n)}
    lps = {key: CompletionLogprobs() for key in choices} if body.logprobs is not None else {}
    echoed: dict[tuple[int, int], str] = {}
    cached = 0
    streams = [(p, model.pool.batches(r)) for p, r in enumerate(reqs)]
    async for p, batch in merge(streams):
        assert batch is not None
        for out in batch:
            key = (p, out.index)
            if body.echo and key not in echoed:
                echoed[key] = _prompt_text(model, reqs[p])
                if key in lps and out.prompt_logprobs is not None:
                    lps[key].add(out.prompt_logprobs)
            choices[key].add(out)
            if key in lps and out.logprobs:
                lps[key].add(out.logprobs)
            cached += out.cached_tokens if out.finished else 0
    rendered = []
    for key, c in sorted(choices.items(), key=lambda kv: kv[1].index):
        rendered.append(
            {
                "index": c.index,
                "text": echoed.get(key, "") + c.content,
                "logprobs": lps[key].as_dict() if key in lps else None,
                "finish_reason": finish(c.finish_reason),
                "stop_reason": c.stop_reason,
            }
        )
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model.served_by(),
        "choices": rendered,
        "usage": usage(prompt_tokens, sum(c.tokens for c in choices.values())),
    }


async def _stream(
    model: ServedModel,
    rid: str,
    reqs: list[GenerationRequest],
    body: CompletionRequest,
    created: int,
    include_usage: bool,
    keep_alive: float,
    admission: Admission,
) -> AsyncIterator[bytes]:
    head = {"id": rid, "object": "text_completion", "created": created, "model": model.id}
    frames = sse.Frames(head)
    n = body.n
    echoed: set[tuple[int, int]] = set()
    keys = [(p, i) for p in range(len(reqs)) for i in range(n)]
    lps = {k: CompletionLogprobs() for k in keys} if body.logprobs is not None else {}
    tokens = 0
    first = True
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    try:
        streams = [(p, model.pool.batches(r, idle_tick=keep_alive)) for p, r in enumerate(reqs)]
        async for p, batch in merge(streams):
            if batch is None:
                yield sse.KEEP_ALIVE
                continue
            if first:  # the first output: a router has chosen who answers
                first = False
                head["model"] = model.served_by()
                frames.set_head(head)
            parts: list[bytes] = []  # one write for everything that was ready together
            for out in batch:
                key = (p, out.index)
                text = out.text
                lp: dict[str, Any] | None = None
                if key in lps:
                    acc = CompletionLogprobs(offset=lps[key].offset)
                    if body.echo and key not in echoed and out.prompt_logprobs is not None:
                        acc.add(out.prompt_logprobs)
                    if out.logprobs:
                        acc.add(out.logprobs)
                    lps[key].offset = acc.offset
                    lp = acc.as_dict()
                if body.echo and key not in echoed:
                    echoed.add(key)
                    text = _prompt_text(model, reqs[p]) + text
                tokens += len(out.token_ids)
                if not text and not out.finished and lp is None:
                    continue
                choice = {
                    "index": p * n + out.index,
                    "text": text,
                    "logprobs": lp,
                    "finish_reason": finish(out.finish_reason),
                    "stop_reason": out.stop_reason,
                }
                parts.append(frames.choice(choice))
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
        if include_usage:
            yield sse.event({**head, "choices": [], "usage": usage(prompt_tokens, tokens)})
        yield sse.DONE
    finally:
        admission.finish(prompt_tokens, tokens)
