"""POST /v1/chat/completions: validate, admit through the generation core,
render chat JSON or chunks."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from engine_adapter.types import EngineOutput, GenerationRequest
from server.ask import RouteAsk, allowed_model, caller_of, ignore_unknown
from server.auth import AuthDep, Principal
from server.chat_bridge import chat_requests
from server.generation import Generation, RelayGeneration, admit, json_response, session_of, stream_response
from server.protocol import ChatCompletionRequest
from server.relay import relay_response
from server.render import DONE, Choice, Frames, Key, chat_logprobs, event, finish
from server.routes.docs import JSON_OR_SSE
from server.state import Gateway, GatewayDep
from server.tools import ToolPlan
from server.validation import new_id

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions", response_model=None, responses=JSON_OR_SSE)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, gw: GatewayDep, principal: AuthDep
) -> Response:
    ignore_unknown(body)
    model = allowed_model(gw, principal, body.model)
    ask = ChatAsk(
        body, gw, principal, await request.body(), caller=caller_of(request, gw, principal, body),
        request_id=new_id("chatcmpl"), stream=body.stream,
        want_usage=bool(body.stream_options and body.stream_options.include_usage),
        max_tokens=body.max_completion_tokens or body.max_tokens, n=body.n,
    )
    gen = await admit(request, gw, principal, model, ask, session_of(request, body.user))
    if isinstance(gen, RelayGeneration):
        return await relay_response(request, gen)
    plan = ask.plan
    if body.stream:
        chunks = _Chunks(gen, plan, body.logprobs, ask.want_usage)
        return stream_response(gen, chunks.render, chunks.tail, gw.settings.sse_keep_alive_interval)
    return await json_response(request, gen, lambda choices: _answer(gen, plan, body.logprobs, choices))


class ChatAsk(RouteAsk):
    """A chat request: for a local engine, tools planned, the chat template
    rendered and tokenized with that engine's tokenizer (server/chat_bridge.py
    `chat_requests`); for upstream nodes, the client's body."""

    path = "/v1/chat/completions"

    def __init__(self, body: ChatCompletionRequest, gw: Gateway, principal: Principal, raw: bytes, **kw: Any) -> None:
        super().__init__(raw, **kw)
        self.body = body
        self.gw = gw
        self.principal = principal
        self.plan = ToolPlan()

    def build(self, pool: Any) -> list[GenerationRequest]:
        self.plan, reqs = chat_requests(
            self.body, pool, self.gw.settings, request_id=self.request_id,
            api_key_name=self.caller.api_key_name, priority=self.caller.priority,
        )
        return reqs


def _answer(gen: Generation, plan: ToolPlan, want_logprobs: bool, choices: dict[Key, Choice]) -> dict[str, Any]:
    rendered = []
    for c in choices.values():
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
    return {
        "id": gen.requests[0].request_id,
        "object": "chat.completion",
        "created": gen.created,
        "model": gen.served_by,
        "choices": rendered,
        "usage": gen.usage(),
    }


class _Chunks:
    """Engine deltas -> chat.completion.chunk events."""

    def __init__(self, gen: Generation, plan: ToolPlan, want_logprobs: bool, include_usage: bool) -> None:
        self.gen = gen
        self.head = {
            "id": gen.requests[0].request_id, "object": "chat.completion.chunk", "created": gen.created,
            "model": gen.served_by,
        }
        self.frames = Frames(self.head)
        n = gen.requests[0].sampling.n
        self.started = [False] * n
        self.streamers = [plan.streamer() if plan.active else None for _ in range(n)]
        self.want_logprobs = want_logprobs
        self.include_usage = include_usage

    def _chunk(self, index: int, delta: dict[str, Any], reason: str | None = None, lps: Any = None,
               stop_reason: str | int | None = None) -> bytes:
        return self.frames.choice(
            {"index": index, "delta": delta, "logprobs": lps, "finish_reason": reason, "stop_reason": stop_reason}
        )

    def render(self, _: int, batch: list[EngineOutput]) -> bytes | None:
        if self.head["model"] != self.gen.served_by:  # an alias fell back before the first token
            self.head["model"] = self.gen.served_by
            self.frames.set_head(self.head)
        parts: list[bytes] = []  # one write for everything that was ready together
        for out in batch:
            i = out.index
            if not self.started[i]:
                self.started[i] = True
                parts.append(self._chunk(i, {"role": "assistant", "content": ""}))
            lps = {"content": chat_logprobs(out.logprobs)} if self.want_logprobs and out.logprobs else None
            streamer = self.streamers[i]
            if streamer is None:
                # one chunk per engine step that made tokens, as vLLM's server: a token whose text is
                # still held back (a partial UTF-8 character) gets `"content": ""`, so clients that count
                # chunks (benchmarks, token-rate meters) see each step when it happens
                if out.text or out.token_ids or out.finished or lps:
                    delta = {"content": out.text} if out.text or out.token_ids else {}
                    parts.append(self._chunk(i, delta, finish(out.finish_reason), lps, out.stop_reason))
                continue
            for delta in streamer.feed(out.text, final=out.finished):
                parts.append(self._chunk(i, delta, None, lps))
                lps = None
            if out.finished:
                reason = "tool_calls" if streamer.called else finish(out.finish_reason)
                parts.append(self._chunk(i, {}, reason, lps, out.stop_reason))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def tail(self) -> bytes:
        if not self.include_usage:
            return DONE
        return event({**self.head, "choices": [], "usage": self.gen.usage()}) + DONE
