"""Chat underneath: how a chat completions request becomes engine requests
(`chat_requests`: the tool plan, the chat template, the token budget, with
the target engine's tokenizer), for chat itself (apis/chat/route.py `ChatAsk`)
and for the APIs translated to chat (OpenAI Responses, Anthropic Messages:
`BridgedAsk`). Both are late-bound Asks: the requests are built for the
target that admission picks, so an alias's targets each tokenize with their
own tokenizer, and a target of upstream nodes gets the API's own call."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from engine_adapter.errors import GatewayError, InvalidRequest
from engine_adapter.types import GenerationRequest
from server.protocol import ChatCompletionRequest
from server.relay_apis import ApiAsk
from server.settings import Settings
from server.tools import ToolPlan, plan_tools
from server.validation import build_chat_request, chat_prompt, structured_from


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
