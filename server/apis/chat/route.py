"""POST /v1/chat/completions: validate, admit through the generation core,
render chat JSON or chunks.

And chat underneath: how a chat completions request becomes engine requests
(`chat_requests`: the tool plan, the chat template, the token budget, with
the target engine's tokenizer), for chat itself (`ChatAsk`) and for the APIs
translated to chat (OpenAI Responses, Anthropic Messages: `as_chat`,
`BridgedAsk`). Both are late-bound Asks: the requests are built for the
target that admission picks, so an alias's targets each tokenize with their
own tokenizer, and a target of upstream nodes gets the API's own call."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from pydantic import ValidationError
from starlette.responses import Response

from engine_adapter.errors import GatewayError, InvalidRequest
from engine_adapter.types import EngineOutput, GenerationRequest
from server.ask import RouteAsk, allowed_model, caller_of, ignore_unknown
from server.auth import AuthDep, Principal
from server.generation import Generation, RelayGeneration, admit, json_response, session_of, stream_response
from server.protocol import ChatCompletionRequest
from server.relay import relay_response
from server.relay_apis import ApiAsk
from server.render import DONE, Choice, Frames, Key, chat_logprobs, event, finish
from server.routes.docs import JSON_OR_SSE
from server.settings import Settings
from server.state import Gateway, GatewayDep
from server.tools import ToolPlan, plan_tools
from server.validation import build_chat_request, chat_prompt, new_id, structured_from

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
    rendered and tokenized with that engine's tokenizer (`chat_requests`);
    for upstream nodes, the client's body."""

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


def chat_requests(
    chat: ChatCompletionRequest,
    pool: Any,
    settings: Settings,
    *,
    request_id: str,
    api_key_name: str | None,
    priority: int,
) -> tuple[ToolPlan, list[GenerationRequest]]:
    """A chat request for the engines of `pool`: tools planned, the chat
    template rendered and tokenized with that pool's tokenizer, the budget
    checked against its card."""
    plan = plan_tools(chat, pool.tokenizer)
    structured = plan.structured or structured_from(chat.response_format, chat)
    prompt, ids = chat_prompt(chat, pool.tokenizer, plan.template_tools, plan.chat_template)
    req = build_chat_request(
        chat,
        request_id=request_id,
        model=pool.name,
        prompt=prompt,
        prompt_ids=ids,
        card=pool.card,
        max_n=settings.max_n,
        timeout=settings.request_timeout,
        structured=structured,
        api_key_name=api_key_name,
        priority=priority,
        vocab_hint=pool.tokenizer.vocab_size,
    )
    return plan, [req]



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


# ---- the APIs translated to chat (server/apis/responses, server/apis/anthropic) --


def as_chat(fields: dict[str, Any], params: dict[str, str] | None = None) -> ChatCompletionRequest:
    """A translated request as chat's model. Its validation errors name the
    caller's own parameters (`params`: chat's name -> the API's)."""
    try:
        return ChatCompletionRequest.model_validate(fields)
    except ValidationError as e:
        first = e.errors()[0]
        loc = [str(p) for p in first.get("loc", ())]
        if loc:
            loc[0] = (params or {}).get(loc[0], loc[0])
        name = ".".join(loc) or None
        raise InvalidRequest(f"invalid value for {name}: {first.get('msg')}", param=name) from None


class BridgedAsk(ApiAsk):
    """A request of an API translated to chat: for a local engine, `chat`
    built as chat's own (`chat_requests`), its errors naming the API's
    parameters (`params`: chat's name -> the API's); for upstream nodes, the
    API's call or its chat translation (ApiAsk). `plan`: the tool plan of
    the last local build (the route renders tool calls with it)."""

    def __init__(self, chat: ChatCompletionRequest, raw: bytes, *, params: dict[str, str], **kw: Any) -> None:
        super().__init__(raw, **kw)
        self.chat = chat
        self.params = params
        self.plan = ToolPlan()

    def build(self, pool: Any) -> list[GenerationRequest]:
        try:
            self.plan, reqs = chat_requests(
                self.chat, pool, self.gw.settings, request_id=self.request_id,
                api_key_name=self.caller.api_key_name, priority=self.caller.priority,
            )
        except GatewayError as e:
            _rename(e, self.params)
            raise
        return reqs


def _rename(e: GatewayError, params: dict[str, str]) -> None:
    if e.param in params:
        new = params[e.param]
        e.message = e.message.replace(e.param, new)
        e.param = new
        e.args = (e.message,)
