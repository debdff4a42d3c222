"""The Anthropic Messages API: `POST /v1/messages` (streamed and not) and
`POST /v1/messages/count_tokens`.

A request is translated to chat (`system` -> a system message, `tool_use`
blocks -> tool calls, `tool_result` blocks -> tool messages, `tool_choice`
any/tool -> required/named) and runs through the generation core as chat
does. Errors on these paths take Anthropic's shape and statuses
(server/errors.py: `ANTHROPIC_KINDS`); keys come as `x-api-key` or Bearer,
and `anthropic-version` is accepted whatever its value.
"""

from __future__ import annotations

import json
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from engine_adapter.errors import EngineError, GatewayError
from server.apis.anthropic.protocol import CountTokensRequest, MessagesRequest, TextBlock, ToolResultBlock, ToolUseBlock
from server.apis.chat.route import BridgedAsk, as_chat
from server.ask import allowed_model, caller_of, ignore_unknown
from server.auth import AuthDep
from server.errors import anthropic_error_event
from server.generation import (
    AnyGeneration,
    RelayGeneration,
    admit,
    admit_relay,
    json_response,
    session_of,
    stream_response,
)
from server.relay_apis import ApiAsk, relayed_response
from server.render import ChatDeltaView, Choice, Key
from server.routes.docs import JSON_OR_SSE
from server.state import GatewayDep
from server.tools import ToolPlan, ToolStreamer, plan_tools
from server.validation import chat_prompt, new_id

router = APIRouter(tags=["anthropic"])

# chat's parameter names -> Anthropic's, for error messages
_PARAMS = {"stop": "stop_sequences", "tool_choice": "tool_choice"}
PING = b'event: ping\ndata: {"type":"ping"}\n\n'
_ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"description": "An Anthropic error: {type: error, error: {type, message}}",
        "content": {"application/json": {}}}
    for s in (400, 401, 403, 404, 405, 413, 415, 429, 500, 503, 504, 529)
}
_JSON_OR_SSE = {**_ERRORS, 200: JSON_OR_SSE[200]}
_JSON: dict[int | str, dict[str, Any]] = {**_ERRORS, 200: {"description": "JSON", "content": {"application/json": {}}}}


def chat_fields(body: MessagesRequest | CountTokensRequest) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = []
    system = body.system_text()
    if system:
        msgs.append({"role": "system", "content": system})
    for m in body.messages:
        if isinstance(m.content, str):
            msgs.append({"role": m.role, "content": m.content})
            continue
        text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
        if m.role == "assistant":
            calls = [
                {"id": b.id, "type": "function",
                 "function": {"name": b.name, "arguments": _dumps(b.input)}}
                for b in m.content if isinstance(b, ToolUseBlock)
            ]
            msg: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
            if calls:
                msg["tool_calls"] = calls
            msgs.append(msg)
            continue
        results = [b for b in m.content if isinstance(b, ToolResultBlock)]
        for r in results:
            msgs.append({"role": "tool", "tool_call_id": r.tool_use_id, "content": r.text()})
        if text or not results:
            msgs.append({"role": "user", "content": text})
    fields: dict[str, Any] = {"model": body.model, "messages": msgs}
    if msgs[-1]["role"] == "assistant" and msgs[-1].get("content"):  # a prefill: the answer continues it
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if body.tools:
        fields["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description,
                                              "parameters": t.input_schema}}
            for t in body.tools
        ]
    tc = body.tool_choice
    if tc is not None:
        if tc.type == "tool":
            fields["tool_choice"] = {"type": "function", "function": {"name": tc.name or ""}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[tc.type]
        if tc.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    if isinstance(body, MessagesRequest):
        fields.update(
            max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
            top_p=body.top_p, top_k=body.top_k, stream=body.stream, priority=body.priority,
            user=body.metadata.user_id if body.metadata else None,
        )
    return {k: v for k, v in fields.items() if v is not None}


@router.post("/v1/messages", response_model=None, responses=_JSON_OR_SSE)
async def create_message(body: MessagesRequest, request: Request, gw: GatewayDep, principal: AuthDep) -> Response:
    ignore_unknown(body)
    fields = chat_fields(body)
    chat = as_chat(fields, _PARAMS)
    model = allowed_model(gw, principal, chat.model)
    rid = new_id("msg")
    # a local engine: the chat translation, built as chat's; upstream nodes: passed through, or that
    # translation sent to their chat completions
    ask = BridgedAsk(
        chat, await request.body(), params=_PARAMS, gw=gw, api="messages", path="/v1/messages",
        via="/v1/chat/completions", translate=lambda: fields, caller=caller_of(request, gw, principal, body),
        request_id=rid, stream=body.stream, want_usage=False, max_tokens=body.max_tokens,
    )
    user = body.metadata.user_id if body.metadata else None
    gen = await admit(request, gw, principal, model, ask, session_of(request, user))
    if isinstance(gen, RelayGeneration):
        view = _Messages(gen, ToolPlan(), rid, late_usage=True)
        return await relayed_response(request, gen, "/v1/messages", view, stream=body.stream)
    view = _Messages(gen, ask.plan, rid)
    if body.stream:
        return stream_response(gen, view.render, view.tail, gw.settings.sse_keep_alive_interval,
                               head=view.head, on_error=anthropic_error_event, ping=PING)
    return await json_response(request, gen, view.answer)


@router.post("/v1/messages/count_tokens", response_model=None, responses=_JSON)
async def count_tokens(body: CountTokensRequest, request: Request, gw: GatewayDep, principal: AuthDep) -> Response:
    fields = chat_fields(body)
    chat = as_chat(fields, _PARAMS)
    model = allowed_model(gw, principal, chat.model)
    if model.pool.relays:  # the node counts: its own count_tokens, else its /tokenize of the chat messages
        rid = new_id("count")
        tokenize = {k: v for k, v in fields.items() if k in ("messages", "tools", "add_generation_prompt",
                                                             "continue_final_message")}
        ask = ApiAsk(
            await request.body(), gw=gw, api="count_tokens", path="/v1/messages/count_tokens", via="/tokenize",
            translate=lambda: tokenize, via_stream=False, caller=caller_of(request, gw, principal), request_id=rid,
            stream=False, want_usage=False, max_tokens=0,
        )
        gen = await admit_relay(request, gw, principal, model, ask, None)
        return await relayed_response(request, gen, "/v1/messages/count_tokens", _Counted(gen), stream=False)
    tok = model.pool.tokenizer
    plan = plan_tools(chat, tok)
    _, ids = chat_prompt(chat, tok, plan.template_tools, plan.chat_template)
    return Response(orjson.dumps({"input_tokens": len(ids)}), media_type="application/json")


class _Counted:
    """A node's /tokenize answer as count_tokens' (a translated call)."""

    def __init__(self, gen: RelayGeneration) -> None:
        self.gen = gen
        self.count = 0

    def from_raw(self, raw: bytes) -> dict[str, Any]:
        try:
            count = orjson.loads(raw).get("count")
        except (ValueError, AttributeError):
            count = None
        if not isinstance(count, int):
            raise EngineError("upstream /tokenize answer has no count", code="upstream_error")
        return {"input_tokens": count}

    def head(self) -> bytes:
        return b""

    def feed(self, delta: dict[str, Any], finish_reason: str | None, stop_reason: str | int | None) -> bytes:
        return b""

    def tail(self) -> bytes:
        return b""

    def whole(self) -> dict[str, Any]:
        return {}

    def failed(self, err: GatewayError) -> bytes:
        return anthropic_error_event(err)


def _dumps(obj: dict[str, Any]) -> str:
    try:
        return orjson.dumps(obj).decode()
    except TypeError:  # orjson refuses integers past 64 bits; JSON does not
        return json.dumps(obj)


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    try:
        obj = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return {}
    return obj if isinstance(obj, dict) else {}


def _stop(finish_reason: str | None, stop_reason: str | int | None) -> tuple[str, str | None]:
    """chat's finish -> Anthropic's (stop_reason, stop_sequence)."""
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


class _Messages(ChatDeltaView):
    """Engine deltas -> a message, or Anthropic's event stream."""

    def __init__(self, gen: AnyGeneration, plan: ToolPlan, rid: str, late_usage: bool = False) -> None:
        self.gen = gen
        self.plan = plan
        self.id = rid.replace("msg-", "msg_", 1)
        self.late_usage = late_usage  # the input's usage is known only at the end (a translated call)
        self.content: list[dict[str, Any]] = []  # the blocks so far (for `whole`)
        self.called = False
        self.streamer: ToolStreamer | None = plan.streamer() if plan.active else None
        self.blocks = 0  # content blocks started
        self.open: int | None = None  # the open block's index
        self.open_text = False
        self.stop_reason = "end_turn"
        self.stop_sequence: str | None = None

    def usage(self) -> dict[str, Any]:
        g = self.gen
        return {"input_tokens": g.prompt_tokens - g.cached_tokens, "output_tokens": g.completion_tokens,
                "cache_read_input_tokens": g.cached_tokens, "cache_creation_input_tokens": 0}

    def message(self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None,
                usage: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.gen.served_by,
                "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    # ---- not streamed ---------------------------------------------------------
    def answer(self, choices: dict[Key, Choice]) -> dict[str, Any]:
        c = next(iter(choices.values()))
        stop_reason, stop_sequence = _stop(c.finish_reason, c.stop_reason)
        text, calls = c.content, None
        if self.plan.active:
            parsed = self.plan.parse(text)
            if parsed is not None:
                text, calls = parsed
        content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text or not calls else []
        for call in calls or []:
            fn = call["function"]
            content.append({"type": "tool_use", "id": _tool_id(call["id"]), "name": fn["name"],
                            "input": _input(fn["arguments"])})
        if calls:
            stop_reason, stop_sequence = "tool_use", None
        return self.message(content, stop_reason, stop_sequence, self.usage())

    # ---- streamed ---------------------------------------------------------------
    @staticmethod
    def _event(kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    def head(self) -> bytes:
        usage = {**self.usage(), "output_tokens": 0}
        return self._event("message_start", message=self.message([], None, None, usage)) + PING

    def _finish(self, finish_reason: str, stop_reason: str | int | None) -> bytes:
        self.stop_reason, self.stop_sequence = _stop(finish_reason, stop_reason)
        if self.called or finish_reason == "tool_calls":
            self.stop_reason, self.stop_sequence = "tool_use", None
        # nothing was said: one empty text block, as the non-streamed answer has
        empty = self._start({"type": "text", "text": ""}) if self.blocks == 0 else b""
        return empty + self._stop_block()

    def whole(self) -> dict[str, Any]:
        """The message, once every delta was fed (a client that does not
        stream, served from a translated call)."""
        content = [{**b, "input": _input(b.pop("_json"))} if b["type"] == "tool_use" else b
                   for b in self.content]
        return self.message(content or [{"type": "text", "text": ""}], self.stop_reason, self.stop_sequence,
                            self.usage())

    def failed(self, err: GatewayError) -> bytes:
        return anthropic_error_event(err)

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self._stop_block()
        self.open = self.blocks
        self.blocks += 1
        self.open_text = block["type"] == "text"
        self.content.append({**block, "_json": ""} if block["type"] == "tool_use" else {**block})
        return out + self._event("content_block_start", index=self.open, content_block=block)

    def _stop_block(self) -> bytes:
        if self.open is None:
            return b""
        i, self.open = self.open, None
        return self._event("content_block_stop", index=i)

    def _text(self, text: str) -> bytes:
        if not text:
            return b""
        head = b"" if self.open is not None and self.open_text else self._start({"type": "text", "text": ""})
        self.content[-1]["text"] += text
        return head + self._event("content_block_delta", index=self.open, delta={"type": "text_delta", "text": text})

    def _tool(self, tc: dict[str, Any]) -> bytes:
        fn = tc.get("function", {})
        head = b""
        if tc.get("id"):
            self.called = True
            head = self._start({"type": "tool_use", "id": _tool_id(tc["id"]), "name": fn["name"], "input": {}})
        args = fn.get("arguments") or ""
        if not args or self.open is None or self.open_text:
            return head
        self.content[-1]["_json"] += args
        return head + self._event("content_block_delta", index=self.open,
                                  delta={"type": "input_json_delta", "partial_json": args})

    def tail(self) -> bytes:
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        usage = self.usage() if self.late_usage else {"output_tokens": self.gen.completion_tokens}
        return (self._event("message_delta", delta=delta, usage=usage)
                + self._event("message_stop"))
