"""The OpenAI Responses API: `POST /v1/responses` (streamed and not), and the
stored responses: `GET` / `DELETE /v1/responses/{id}`, `GET
/v1/responses/{id}/input_items`.

A request is translated to chat (input items -> messages, `instructions` ->
a system message, `text.format` -> `response_format`, function tools) and
runs through the generation core as chat does. A stored response keeps the
conversation through it, so `previous_response_id` rebuilds it; a key sees
only its own responses (another key's id is a 404).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from starlette.responses import Response

from engine_adapter.errors import NotFound
from server.apis.chat.route import BridgedAsk, as_chat
from server.apis.responses.protocol import InputItemsQuery, ResponsesRequest
from server.apis.responses.render import ResponsesView, _hex
from server.ask import caller_of, ignore_unknown
from server.auth import AuthDep
from server.generation import RelayGeneration, admit, json_response, session_of, stream_response
from server.relay_apis import relayed_response
from server.routes.docs import ERRORS, JSON_OR_SSE
from server.state import GatewayDep
from server.store import ResponseStore, StoredResponse
from server.tools import ToolPlan
from server.validation import new_id


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    store = ResponseStore.from_settings(app.state.settings)
    app.state.responses = store
    try:
        yield
    finally:
        await store.close()


router = APIRouter(tags=["openai"], lifespan=_lifespan)

# chat's parameter names -> the Responses API's, for error messages
_PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
JSON: dict[int | str, dict[str, Any]] = {**ERRORS, 200: {"description": "JSON", "content": {"application/json": {}}}}


async def get_store(request: Request) -> ResponseStore:
    store: ResponseStore = request.app.state.responses
    return store


StoreDep = Annotated[ResponseStore, Depends(get_store)]


# ---- input items <-> chat messages ------------------------------------------
def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as stored items, each with an id."""
    if isinstance(body.input, str):
        return [_message("user", body.input, "input_text")]
    out: list[dict[str, Any]] = []
    for item in body.input:
        d = item.model_dump(exclude_none=True)
        if item.type == "message":
            kind = "output_text" if item.role == "assistant" else "input_text"
            d = {**_message(item.role, item.text(), kind), **({"id": item.id} if item.id else {})}
        elif item.type == "function_call":
            d = {"id": item.id or f"fc_{_hex()}", **d, "status": "completed"}
        else:
            d = {"id": item.id or f"fco_{_hex()}", **d, "output": item.text(), "status": "completed"}
        out.append(d)
    return out


def _message(role: str, text: str, kind: str) -> dict[str, Any]:
    part: dict[str, Any] = {"type": kind, "text": text}
    if kind == "output_text":
        part["annotations"] = []
    return {"id": f"msg_{_hex()}", "type": "message", "role": role, "content": [part], "status": "completed"}


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stored items -> chat messages: a function call joins the assistant
    message before it; its output is a `tool` message."""
    out: list[dict[str, Any]] = []
    for it in items:
        t = it.get("type", "message")
        if t == "message":
            content = it["content"]
            text = content if isinstance(content, str) else "".join(p.get("text", "") for p in content)
            out.append({"role": it["role"], "content": text})
        elif t == "function_call":
            call = {"id": it["call_id"], "type": "function",
                    "function": {"name": it["name"], "arguments": it["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
                if not last["content"]:
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif t == "function_call_output":
            out.append({"role": "tool", "tool_call_id": it["call_id"], "content": it["output"]})
    return out


def _chat_fields(body: ResponsesRequest, messages: list[dict[str, Any]]) -> dict[str, Any]:
    if body.instructions:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    fields: dict[str, Any] = {
        "model": body.model, "messages": messages, "max_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "seed": body.seed,
        "stream": body.stream, "user": body.user, "priority": body.priority,
        "parallel_tool_calls": body.parallel_tool_calls,
    }
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)} for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        fields["tool_choice"] = choice if isinstance(choice, str) else {
            "type": "function", "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        fields["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.json_schema, "strict": fmt.strict}}
    return {k: v for k, v in fields.items() if v is not None}


# ---- routes -------------------------------------------------------------------
@router.post("/v1/responses", response_model=None, responses=JSON_OR_SSE)
async def create_response(
    body: ResponsesRequest, request: Request, gw: GatewayDep, principal: AuthDep, store: StoreDep
) -> Response:
    ignore_unknown(body)
    owner = principal.name or ""
    before: list[dict[str, Any]] = []
    model = gw.resolve(body.model)
    relays = model.pool.relays
    chained = False  # a chain stored here: nodes cannot continue it, so it is translated for them
    if body.previous_response_id is not None:
        prev = await store.get(body.previous_response_id, owner)
        if prev is None and not relays:
            raise NotFound(f"Previous response with id '{body.previous_response_id}' not found.",
                           param="previous_response_id")
        if prev is not None:
            before, chained = prev.context, True
    items = input_items(body)
    fields = _chat_fields(body, chat_messages([*before, *items]))
    chat = as_chat(fields, _PARAMS)
    principal.check_model(model.id)
    rid = new_id("resp")
    # a local engine: the chat translation, built as chat's; upstream nodes: passed through to those that
    # serve the Responses API (they store the response, not the gateway), else translated to chat (stored
    # here, as a local one). A chain stored here (`chained`) is always translated: nodes cannot continue it.
    ask = BridgedAsk(
        chat, await request.body(), params=_PARAMS, gw=gw, api="responses", path="/v1/responses",
        via="/v1/chat/completions", translate=lambda: fields, native=not chained,
        caller=caller_of(request, gw, principal, body), request_id=rid, stream=body.stream, want_usage=False,
        max_tokens=body.max_output_tokens,
    )
    gen = await admit(request, gw, principal, model, ask, session_of(request, body.user))
    if isinstance(gen, RelayGeneration):
        view = ResponsesView(gen, ToolPlan(), body, store, owner, items, before, rid)
        return await relayed_response(request, gen, "/v1/responses", view, stream=body.stream)
    view = ResponsesView(gen, ask.plan, body, store, owner, items, before, rid)
    if body.stream:
        return stream_response(gen, view.render, view.tail, gw.settings.sse_keep_alive_interval,
                               head=view.head, on_error=view.failed)
    return await json_response(request, gen, view.answer)


@router.get("/v1/responses/{response_id}", response_model=None, responses=JSON)
async def get_response(response_id: str, principal: AuthDep, store: StoreDep) -> dict[str, Any]:
    return (await _stored(store, response_id, principal.name)).response


@router.delete("/v1/responses/{response_id}", response_model=None, responses=JSON)
async def delete_response(response_id: str, principal: AuthDep, store: StoreDep) -> dict[str, Any]:
    if not await store.delete(response_id, principal.name or ""):
        raise _not_found(response_id)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/v1/responses/{response_id}/input_items", response_model=None, responses=JSON)
async def list_input_items(
    response_id: str, principal: AuthDep, store: StoreDep, query: Annotated[InputItemsQuery, Query()]
) -> dict[str, Any]:
    items = list((await _stored(store, response_id, principal.name)).input_items)
    if query.order == "desc":
        items.reverse()
    if query.after is not None:
        ids = [it.get("id") for it in items]
        items = items[ids.index(query.after) + 1:] if query.after in ids else []
    page = items[: query.limit]
    return {
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(items) > len(page),
    }


async def _stored(store: ResponseStore, rid: str, owner: str | None) -> StoredResponse:
    rec = await store.get(rid, owner or "")
    if rec is None:
        raise _not_found(rid)
    return rec


def _not_found(rid: str) -> NotFound:
    return NotFound(f"No response found with id '{rid}'.", param="response_id")


