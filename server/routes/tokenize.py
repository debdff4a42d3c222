"""POST /tokenize and /detokenize (vLLM's shapes), GET /version."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from engine_adapter.errors import InvalidRequest
from server.ask import allowed_model
from server.auth import AuthDep
from server.protocol import ChatCompletionRequest, DetokenizeRequest, TokenizeRequest
from server.routes.docs import ERRORS
from server.state import GatewayDep
from server.tools import plan_tools
from server.validation import chat_prompt

router = APIRouter(tags=["vllm"])


@router.post("/tokenize", response_model=None, responses=ERRORS)
async def tokenize(body: TokenizeRequest, gw: GatewayDep, principal: AuthDep) -> dict[str, Any]:
    model = allowed_model(gw, principal, body.model, kind=_kind(gw, body.model))
    await model.pool.ensure_started()
    tok = model.pool.tokenizer
    if body.messages is not None:
        chat = ChatCompletionRequest.model_construct(
            model=model.id, messages=body.messages, add_generation_prompt=body.add_generation_prompt,
            continue_final_message=False, chat_template=None, tools=None, tool_choice=None,
        )
        plan = plan_tools(chat, tok)
        _, ids = chat_prompt(chat, tok, None, plan.chat_template)
    else:
        assert body.prompt is not None
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    out: dict[str, Any] = {"count": len(ids), "max_model_len": model.pool.card.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = tok.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize", response_model=None, responses=ERRORS)
async def detokenize(body: DetokenizeRequest, gw: GatewayDep, principal: AuthDep) -> dict[str, Any]:
    model = allowed_model(gw, principal, body.model, kind=_kind(gw, body.model))
    await model.pool.ensure_started()
    tok = model.pool.tokenizer
    if body.tokens and max(body.tokens) >= tok.vocab_size:
        raise InvalidRequest("tokens hold an id outside the vocabulary", param="tokens")
    return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}


def _kind(gw: Any, name: str | None) -> str:
    m = gw.models.get(name) if name else None
    return str(m.kind) if m is not None else "generate"


@router.get("/version", responses=ERRORS)
async def version() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        v = pkg_version("npu-gateway")
    except PackageNotFoundError:
        v = "0+unknown"
    return {"version": v}
