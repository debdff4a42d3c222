"""POST /v1/chat/completions"""

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
from server.protocol import ChatCompletionRequest
from server.render import Choice, chat_logprobs, finish, usage
from server.routes.docs import JSON_OR_SSE
from server.state import ServedModel
from server.streaming import guarded, sse_response, until_disconnect
from server.tools import ToolPlan, plan_tools
from server.validation import build_chat_request, chat_prompt, new_id, structured_from

logger = logging.getLogger(__name__)
router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions", response_model=None, responses=JSON_OR_SSE)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, gw: GatewayDep, principal: AuthDep
) -> Response:
    if body.model_extra:
        logger.debug("ignoring unknown fields: %s", ", ".join(body.unknown_fields()))
    model = gw.resolve(body.model)
    principal.check_model(model.id)
    pool = model.pool
    plan = plan_tools(body, pool.tokenizer)
    structured = plan.structured or structured_from(body.response_format, body)
    prompt, ids = chat_prompt(body, pool.tokenizer, plan.template_tools, plan.chat_template)
    rid = new_id("chatcmpl")
    req = build_chat_request(
        body,
        request_id=rid,
        model=model.id,
        prompt=prompt,
        prompt_ids=ids,
        card=pool.card,
        max_n=gw.settings.max_n,
        timeout=gw.settings.request_timeout,
        structured=structured,
        api_key_name=principal.name,
        priority=principal.priority_for(body.priority, "priority" in body.model_fields_set),
        vocab_hint=pool.tokenizer.vocab_size,
    )
    admission = await gw.limits.admit(principal, model.id, len(ids) + req.sampling.max_tokens * req.sampling.n)
    created = int(time.time())
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        keep_alive = gw.settings.sse_keep_alive_interval
        events = _stream(model, req, plan, created, include_usage, body.logprobs, keep_alive, admission)
        return sse_response(guarded(events, admission.fail), admission.headers())
    try:
        result = await until_disconnect(request, _collect(model, req, plan, created, body.logprobs))
    except BaseException:
        admission.finish(0)
        raise
    admission.finish(result["usage"]["prompt_tokens"], result["usage"]["completion_tokens"])
    return Response(orjson.dumps(result), media_type="application/json", headers=admission.headers())


async def _collect(
    model: ServedModel, req: GenerationRequest, plan: ToolPlan, created: int, want_logprobs: bool
) -> dict[str, Any]:
    choices = [Choice(i) for i in range(req.sampling.n)]
    prompt_tokens = len(req.prompt_token_ids)
    cached = 0
    async for batch in model.pool.batches(req):
        assert batch is not None
        for out in batch:
            choices[out.index].add(out)
            cached = out.cached_tokens or cached
    rendered = []
    for c in choices:
        message: dict[str, Any] = {"role": "assistant", "content": c.content}
        reason = finish(c.finish_reason)
        calls = plan.parse(c.content) if plan.active else None
        if calls is not None:
            content, tool_calls = calls
            message["content"] = content or None
            message["tool_calls"] = tool_calls
            reason = "tool_calls"
        rendered.append(
            {
                "index": c.index,
                "message": message,
                "logprobs": {"content": chat_logprobs(c.logprobs)} if want_logprobs else None,
                "finish_reason": reason,
                "stop_reason": c.stop_reason,
            }
        )
    completion_tokens = sum(c.tokens for c in choices)
    return {
        "id": req.request_id,
        "object": "chat.completion",
        "created": created,
        "model": model.served_by(),
        "choices": rendered,
        "usage": usage(prompt_tokens, completion_tokens, cached),
    }


async def _stream(
    model: ServedModel,
    req: GenerationRequest,
    plan: ToolPlan,
    created: int,
    include_usage: bool,
    want_logprobs: bool,
    keep_alive: float,
    admission: Admission,
) -> AsyncIterator[bytes]:
    head = {"id": req.request_id, "object": "chat.completion.chunk", "created": created, "model": model.id}
    frames = sse.Frames(head)
    n = req.sampling.n
    started = [False] * n
    tokens = [0] * n
    streamers = [plan.streamer() if plan.active else None for _ in range(n)]
    cached = 0
    first = True

    def chunk(index: int, delta: dict[str, Any], reason: str | None = None, lps: Any = None) -> bytes:
        return frames.choice({"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason})

    try:
        async for batch in model.pool.batches(req, idle_tick=keep_alive):
            if batch is None:
                yield sse.KEEP_ALIVE
                continue
            if first:  # the first output: a router has chosen who answers
                first = False
                head["model"] = model.served_by()
                frames.set_head(head)
            parts: list[bytes] = []  # one write for everything that was ready together
            for out in batch:
                i = out.index
                cached = out.cached_tokens or cached
                if not started[i]:
                    started[i] = True
                    parts.append(chunk(i, {"role": "assistant", "content": ""}))
                tokens[i] += len(out.token_ids)
                lps = {"content": chat_logprobs(out.logprobs)} if want_logprobs and out.logprobs else None
                streamer = streamers[i]
                if streamer is None:
                    if out.text or out.finished or lps:
                        delta = {"content": out.text} if out.text else {}
                        parts.append(chunk(i, delta, finish(out.finish_reason), lps))
                    continue
                for delta in streamer.feed(out.text, final=out.finished):
                    parts.append(chunk(i, delta, None, lps))
                    lps = None
                if out.finished:
                    reason = "tool_calls" if streamer.called else finish(out.finish_reason)
                    parts.append(chunk(i, {}, reason, lps))
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
        total = sum(tokens)
        if include_usage:
            yield sse.event({**head, "choices": [], "usage": usage(len(req.prompt_token_ids), total, cached)})
        yield sse.DONE
        admission.finish(len(req.prompt_token_ids), total)
    except BaseException:
        admission.finish(len(req.prompt_token_ids), sum(tokens))
        raise
