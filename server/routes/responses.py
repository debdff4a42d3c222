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

import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Depends, FastAPI, Query, Request
from starlette.responses import Response

from engine_adapter.errors import GatewayError, NotFound
from engine_adapter.types import EngineOutput
from server.chat_bridge import as_chat, prepare
from server.deps import AuthDep, GatewayDep
from server.errors import kind_of
from server.generation import Generation, Key, admit, json_response, session_of, stream_response
from server.protocol_responses import InputItemsQuery, ResponsesRequest
from server.render import Choice
from server.routes.docs import ERRORS, JSON_OR_SSE
from server.store import ResponseStore, StoredResponse
from server.tools import ToolPlan, ToolStreamer

logger = logging.getLogger(__name__)


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


def _hex() -> str:
    return uuid.uuid4().hex


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
    if body.model_extra:
        logger.debug("ignoring unknown fields: %s", ", ".join(body.unknown_fields()))
    owner = principal.name or ""
    before: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        prev = await store.get(body.previous_response_id, owner)
        if prev is None:
            raise NotFound(f"Previous response with id '{body.previous_response_id}' not found.",
                           param="previous_response_id")
        before = prev.context
    items = input_items(body)
    chat = as_chat(_chat_fields(body, chat_messages([*before, *items])), _PARAMS)
    plan = prepare(gw, principal, chat, id_prefix="resp", priority=body.priority,
                   explicit_priority="priority" in body.model_fields_set, params=_PARAMS)
    gen = await admit(request, gw, principal, plan.model, [plan.request], session_of(request, body.user))
    view = _Responses(gen, plan.tools, body, store, owner, items, before)
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


# ---- rendering ----------------------------------------------------------------
class _Responses:
    """Engine deltas -> a response object, or its event stream; the finished
    response is stored when `store` is set."""

    def __init__(self, gen: Generation, plan: ToolPlan, body: ResponsesRequest, store: ResponseStore, owner: str,
                 items: list[dict[str, Any]], before: list[dict[str, Any]]) -> None:
        self.gen = gen
        self.plan = plan
        self.body = body
        self.store = store
        self.owner = owner
        self.items = items
        self.before = before
        self.id = gen.requests[0].request_id.replace("resp-", "resp_", 1)
        # streaming state
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.msg: dict[str, Any] | None = None  # the open message item
        self.msg_text: list[str] = []  # its text so far
        self.calls: dict[int, dict[str, Any]] = {}  # open function calls by tool-call index
        self.streamer: ToolStreamer | None = plan.streamer() if plan.active else None
        self.finish_reason: str | None = None

    # ---- the response object ------------------------------------------------
    def usage(self) -> dict[str, Any]:
        g = self.gen
        return {
            "input_tokens": g.prompt_tokens, "input_tokens_details": {"cached_tokens": g.cached_tokens},
            "output_tokens": g.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": g.prompt_tokens + g.completion_tokens,
        }

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        choice = b.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.gen.created, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "model": self.gen.served_by,
            "output": output, "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "store": b.store and self.store.enabled,
            "temperature": 1.0 if b.temperature is None else b.temperature,
            "text": {"format": fmt or {"type": "text"}},
            "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice else "auto",
            "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
            "top_p": 1.0 if b.top_p is None else b.top_p, "truncation": "disabled",
            "metadata": b.metadata or {}, "user": b.user, "usage": usage,
        }

    def _finished(self, output: list[dict[str, Any]]) -> dict[str, Any]:
        called = any(it["type"] == "function_call" for it in output)
        status = "incomplete" if self.finish_reason == "length" and not called else "completed"
        resp = self.response(status, output, self.usage())
        if self.body.store and self.store.enabled:
            self.store.save(StoredResponse(
                id=self.id, owner=self.owner, created_at=self.gen.created, model=self.gen.served_by,
                response=resp, input_items=self.items, context=[*self.before, *self.items, *output],
            ))
        return resp

    # ---- not streamed ---------------------------------------------------------
    def answer(self, choices: dict[Key, Choice]) -> dict[str, Any]:
        c = next(iter(choices.values()))
        self.finish_reason = c.finish_reason
        text, calls = c.content, None
        if self.plan.active:
            parsed = self.plan.parse(text)
            if parsed is not None:
                text, calls = parsed
        output = [] if calls and not text else [_text_item(f"msg_{_hex()}", text, "completed")]
        for call in calls or []:
            fn = call["function"]
            output.append(_call_item(f"fc_{_hex()}", call["id"], fn["name"], fn["arguments"], "completed"))
        return self._finished(output)

    # ---- streamed ---------------------------------------------------------------
    def _event(self, kind: str, **fields: Any) -> bytes:
        self.seq += 1
        data = orjson.dumps({"type": kind, "sequence_number": self.seq - 1, **fields})
        return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"

    def head(self) -> bytes:
        snap = self.response("in_progress", [])
        return self._event("response.created", response=snap) + self._event("response.in_progress", response=snap)

    def render(self, _: int, batch: list[EngineOutput]) -> bytes | None:
        parts: list[bytes] = []
        for out in batch:
            if self.streamer is None:
                parts.append(self._text(out.text))
            else:
                for d in self.streamer.feed(out.text, final=out.finished):
                    if d.get("content"):
                        parts.append(self._text(d["content"]))
                    for tc in d.get("tool_calls", ()):
                        parts.append(self._tool(tc))
            if out.finished:
                self.finish_reason = out.finish_reason
                parts.append(self._close())
        return b"".join(parts) or None

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        head = b""
        if self.msg is None:
            self.msg = _text_item(f"msg_{_hex()}", "", "in_progress")
            self.msg["content"] = []
            self.output.append(self.msg)
            head = self._event("response.output_item.added", output_index=len(self.output) - 1, item=self.msg) + \
                self._event("response.content_part.added", item_id=self.msg["id"], output_index=len(self.output) - 1,
                            content_index=0, part={"type": "output_text", "text": "", "annotations": []})
            self.msg_text = []
        self.msg_text.append(text)
        return head + self._event("response.output_text.delta", item_id=self.msg["id"],
                                  output_index=self.output.index(self.msg), content_index=0, delta=text, logprobs=[])

    def _tool(self, tc: dict[str, Any]) -> bytes:
        fn = tc.get("function", {})
        head = b""
        if "id" in tc:
            head = self._close_message()
            item = _call_item(f"fc_{_hex()}", tc["id"], fn["name"], "", "in_progress")
            self.output.append(item)
            self.calls[tc["index"]] = item
            head += self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)
        item = self.calls[tc["index"]]
        args = fn.get("arguments") or ""
        if not args:
            return head
        item["arguments"] += args
        return head + self._event("response.function_call_arguments.delta", item_id=item["id"],
                                  output_index=self.output.index(item), delta=args)

    def _close_message(self) -> bytes:
        msg, self.msg = self.msg, None
        if msg is None:
            return b""
        text = "".join(self.msg_text)
        i = self.output.index(msg)
        done = _text_item(msg["id"], text, "completed")
        self.output[i] = done
        part = done["content"][0]
        return (self._event("response.output_text.done", item_id=msg["id"], output_index=i, content_index=0,
                            text=text, logprobs=[])
                + self._event("response.content_part.done", item_id=msg["id"], output_index=i, content_index=0,
                              part=part)
                + self._event("response.output_item.done", output_index=i, item=done))

    def _close(self) -> bytes:
        if not self.output:  # nothing was said: an empty message, as the non-streamed answer has
            self.msg = {**_text_item(f"msg_{_hex()}", "", "in_progress"), "content": []}
            self.msg_text = []
            self.output.append(self.msg)
            added = self._event("response.output_item.added", output_index=0, item=self.msg)
            added += self._event("response.content_part.added", item_id=self.msg["id"], output_index=0,
                                 content_index=0, part={"type": "output_text", "text": "", "annotations": []})
        else:
            added = b""
        parts = [added, self._close_message()]
        for item in self.calls.values():
            i = self.output.index(item)
            item["status"] = "completed"
            parts.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=i,
                                     name=item["name"], arguments=item["arguments"]))
            parts.append(self._event("response.output_item.done", output_index=i, item=item))
        self.calls = {}
        return b"".join(parts)

    def tail(self) -> bytes:
        resp = self._finished(self.output)
        kind = "response.incomplete" if resp["status"] == "incomplete" else "response.completed"
        return self._event(kind, response=resp)

    def failed(self, err: GatewayError) -> bytes:
        kind = kind_of(err)
        error = {"code": err.code or kind.type, "message": err.message}
        return self._event("response.failed", response=self.response("failed", [], self.usage(), error))


def _text_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}
