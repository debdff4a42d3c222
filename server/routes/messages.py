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
import logging
from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response

from engine_adapter.types import EngineOutput
from server.chat_bridge import as_chat, prepare
from server.deps import AuthDep, GatewayDep
from server.errors import anthropic_error_event
from server.generation import Generation, Key, admit, json_response, session_of, stream_response
from server.protocol_anthropic import CountTokensRequest, MessagesRequest, TextBlock, ToolResultBlock, ToolUseBlock
from server.render import Choice
from server.routes.docs import JSON_OR_SSE
from server.tools import ToolPlan, ToolStreamer, plan_tools
from server.validation import chat_prompt

logger = logging.getLogger(__name__)
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
    if body.model_extra:
        logger.debug("ignoring unknown fields: %s", ", ".join(body.unknown_fields()))
    chat = as_chat(chat_fields(body), _PARAMS)
    plan = prepare(gw, principal, chat, id_prefix="msg", priority=body.priority,
                   explicit_priority="priority" in body.model_fields_set, params=_PARAMS)
    user = body.metadata.user_id if body.metadata else None
    gen = await admit(request, gw, principal, plan.model, [plan.request], session_of(request, user))
    view = _Messages(gen, plan.tools)
    if body.stream:
        return stream_response(gen, view.render, view.tail, gw.settings.sse_keep_alive_interval,
                               head=view.head, on_error=anthropic_error_event, ping=PING)
    return await json_response(request, gen, view.answer)


@router.post("/v1/messages/count_tokens", response_model=None, responses=_JSON)
async def count_tokens(body: CountTokensRequest, gw: GatewayDep, principal: AuthDep) -> dict[str, Any]:
    chat = as_chat(chat_fields(body), _PARAMS)
    model = gw.resolve(chat.model)
    principal.check_model(model.id)
    tok = model.pool.tokenizer
    plan = plan_tools(chat, tok)
    _, ids = chat_prompt(chat, tok, plan.template_tools, plan.chat_template)
    return {"input_tokens": len(ids)}


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


class _Messages:
    """Engine deltas -> a message, or Anthropic's event stream."""

    def __init__(self, gen: Generation, plan: ToolPlan) -> None:
        self.gen = gen
        self.plan = plan
        self.id = gen.requests[0].request_id.replace("msg-", "msg_", 1)
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
                self.stop_reason, self.stop_sequence = _stop(out.finish_reason, out.stop_reason)
                if self.streamer is not None and self.streamer.called:
                    self.stop_reason, self.stop_sequence = "tool_use", None
                if self.blocks == 0:  # nothing was said: one empty text block, as the non-streamed answer
                    parts.append(self._start({"type": "text", "text": ""}))
                parts.append(self._stop_block())
        return b"".join(parts) or None

    def _start(self, block: dict[str, Any]) -> bytes:
        out = self._stop_block()
        self.open = self.blocks
        self.blocks += 1
        self.open_text = block["type"] == "text"
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
        return head + self._event("content_block_delta", index=self.open, delta={"type": "text_delta", "text": text})

    def _tool(self, tc: dict[str, Any]) -> bytes:
        fn = tc.get("function", {})
        head = b""
        if "id" in tc:
            head = self._start({"type": "tool_use", "id": _tool_id(tc["id"]), "name": fn["name"], "input": {}})
        args = fn.get("arguments") or ""
        if not args:
            return head
        return head + self._event("content_block_delta", index=self.open,
                                  delta={"type": "input_json_delta", "partial_json": args})

    def tail(self) -> bytes:
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return (self._event("message_delta", delta=delta, usage={"output_tokens": self.gen.completion_tokens})
                + self._event("message_stop"))
