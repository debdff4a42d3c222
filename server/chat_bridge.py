"""The APIs that are chat underneath (OpenAI Responses, Anthropic Messages):
their request, translated into a chat completions request, is validated
and prepared exactly as chat's: the tool plan, the chat template, the token
budget, into one frozen `GenerationRequest`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from engine_adapter.errors import GatewayError, InvalidRequest
from engine_adapter.types import GenerationRequest
from server.auth import Principal
from server.protocol import ChatCompletionRequest
from server.state import Gateway, ServedModel
from server.tools import ToolPlan, plan_tools
from server.validation import build_chat_request, chat_prompt, new_id, structured_from


@dataclass(frozen=True, slots=True)
class ChatPlan:
    model: ServedModel
    chat: ChatCompletionRequest
    tools: ToolPlan
    request: GenerationRequest


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


def prepare(
    gw: Gateway,
    principal: Principal,
    chat: ChatCompletionRequest,
    *,
    id_prefix: str,
    priority: int,
    explicit_priority: bool,
    params: dict[str, str] | None = None,
) -> ChatPlan:
    """Resolve the model, check the key may use it, plan tools, render the
    prompt and validate the budget. Errors name the API's own parameters."""
    model = gw.resolve(chat.model)
    principal.check_model(model.id)
    pool = model.pool
    try:
        plan = plan_tools(chat, pool.tokenizer)
        structured = plan.structured or structured_from(chat.response_format, chat)
        prompt, ids = chat_prompt(chat, pool.tokenizer, plan.template_tools, plan.chat_template)
        req = build_chat_request(
            chat,
            request_id=new_id(id_prefix),
            model=model.id,
            prompt=prompt,
            prompt_ids=ids,
            card=pool.card,
            max_n=gw.settings.max_n,
            timeout=gw.settings.request_timeout,
            structured=structured,
            api_key_name=principal.name,
            priority=principal.priority_for(priority, explicit_priority),
            vocab_hint=pool.tokenizer.vocab_size,
        )
    except GatewayError as e:
        _rename(e, params or {})
        raise
    return ChatPlan(model, chat, plan, req)


def _rename(e: GatewayError, params: dict[str, str]) -> None:
    if e.param in params:
        new = params[e.param]
        e.message = e.message.replace(e.param, new)
        e.param = new
        e.args = (e.message,)
